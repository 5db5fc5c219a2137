"""Weight precision and layout: real fp16/bf16 casts, the decoder's default dtype per model version and device
(on CPU per stage, from the CPU's matrix units and the stage's size), the guard that recomputes a non-finite
reduced-precision output in float32, INT8 dynamic quantization and oneDNN-packed float32 Linear layers (both for
CPU)."""

from __future__ import annotations

import logging
import platform
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.ao.nn.quantized import dynamic as quantized_dynamic
from torch.ao.quantization import quantize_dynamic

from engine.errors import InvalidInputError
from engine.nn import layers

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
AUTO_DTYPE = "auto"
AUTO_INT4_DTYPE = "auto-int4"  # `auto` on CPU with the LLM's Linear weights in INT4 instead of INT8


def parse_dtype(name: str) -> torch.dtype:
    """'float32' / 'float16' / 'bfloat16' (also 'fp32', 'fp16', 'bf16') -> torch dtype."""
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    key = aliases.get(name, name)
    if key not in DTYPES:
        raise InvalidInputError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[key]


@dataclass(frozen=True)
class DecoderDtypes:
    """The dtype of each decoder module's weights; `llm_quantization`: how the (float32, CPU) LLM's Linear layers are
    quantized, "int8" (dynamic) or "int4" (weight-only, `quantize_linear_int4`), None for not at all; `reason`: why
    `auto` chose so (for the startup log and `/v1/models`)."""

    llm: torch.dtype
    flow: torch.dtype
    hift: torch.dtype
    llm_quantization: str | None = None
    reason: str = field(default="", compare=False)

    def describe(self) -> dict[str, str]:
        """{'llm': 'int8' / 'bfloat16' / ..., 'flow': ..., 'hift': ...}: what each decoder module runs in."""
        names = {dtype: name for name, dtype in DTYPES.items()}
        return {
            "llm": self.llm_quantization or names[self.llm],
            "flow": names[self.flow],
            "hift": names[self.hift],
        }


CPU_FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx_vnni", "avx2")


@dataclass(frozen=True)
class CpuCapabilities:
    """The CPU's matrix and vector units that matter for the decoder's precision: the /proc/cpuinfo flags among
    CPU_FLAGS, torch's own dispatch level (`torch.backends.cpu.get_cpu_capability()`: DEFAULT, AVX2, AVX512,
    ...), the model name and the vendor (`vendor_id`: GenuineIntel, AuthenticAMD)."""

    flags: frozenset[str]
    torch_capability: str = ""
    model: str = ""
    vendor: str = ""

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.flags

    @property
    def native_bfloat16(self) -> bool:
        """bfloat16 products in hardware: AMX tiles or AVX512-BF16 dot products (oneDNN uses either)."""
        return "amx_bf16" in self.flags or "avx512_bf16" in self.flags

    @property
    def kernel_kind(self) -> str:
        """What decides how a float32 kernel rounds: the vendor (MKL dispatches by it), torch's vector level and
        whether oneDNN may take its AMX-era kernels. Two machines of one kind give the same float32 results; the
        conformance kits record it with the official outputs (`recorded_cpu_kind`)."""
        amx = ", AMX" if self.amx else ""
        return f"{self.vendor or 'unknown vendor'}, {self.torch_capability or 'unknown vector level'}{amx}"

    def describe(self) -> str:
        units = [flag for flag in CPU_FLAGS if flag in self.flags]
        return f"{self.model or 'unknown CPU'} ({', '.join(units) or 'no AVX2'}; torch {self.torch_capability})"


def parse_cpuinfo(text: str) -> tuple[frozenset[str], str, str]:
    """(the flags among CPU_FLAGS, the model name, the vendor) of the first processor in a /proc/cpuinfo text."""
    flags: set[str] = set()
    model = vendor = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(value.split()) & set(CPU_FLAGS)
        elif key == "model name" and not model:
            model = value.strip()
        elif key == "vendor_id" and not vendor:
            vendor = value.strip()
    return frozenset(flags), model, vendor


@lru_cache(maxsize=1)
def cpu_capabilities() -> CpuCapabilities:
    """This machine's CPU (read once). Without /proc/cpuinfo (not Linux) no flags: `auto` stays float32."""
    try:
        flags, model, vendor = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags, model, vendor = frozenset(), platform.processor(), ""
    return CpuCapabilities(flags, torch.backends.cpu.get_cpu_capability(), model, vendor)


def gemm_parameters(module: nn.Module | None) -> int:
    """Weights of the module's Linear and convolution layers (embeddings and norms left out): what its compute
    scales with, the size that says whether reduced precision pays for a stage (`cpu_auto_choice`)."""
    if module is None:
        return 0
    kinds = (nn.Linear, nn.Conv1d, nn.ConvTranspose1d, nn.Conv2d, layers.PackedLinear)
    total = 0
    for child in module.modules():
        if isinstance(child, layers.PackedLinear):
            total += child.in_features * child.out_features
        elif isinstance(child, kinds):
            total += child.weight.numel()
    return total


def module_sizes(llm: nn.Module | None, flow: nn.Module | None, hift: nn.Module | None) -> dict[str, int]:
    return {"llm": gemm_parameters(llm), "flow": gemm_parameters(flow), "hift": gemm_parameters(hift)}


# Below this many GEMM weights a stage is bound by per-operation overhead, not by its products: reduced precision
# only adds casts there (measured on the tiny presets and kits, docs/performance.md, "CPU precision").
MIN_REDUCED_PRECISION_PARAMETERS = 16_000_000


def cpu_auto_choice(caps: CpuCapabilities, sizes: dict[str, int], llm_int4: bool = False) -> DecoderDtypes:
    """`auto` on CPU, per stage, from the CPU's units and the stage's size (GEMM weights, `gemm_parameters`);
    `llm_int4` (`auto-int4`) puts the LLM's Linear weights in INT4 whatever its size.
    Measured with `benchmarks/cpu_bench.py` (docs/performance.md, "CPU precision per stage"; 2 threads of an AMD
    EPYC with AVX512-BF16, no AMX, real-size dummies of v1, v2 and v3, each variant against float32 in one run):

    - flow: compute bound; with native bfloat16 (AMX or AVX512-BF16) bfloat16 weights and activations (norms,
      softmax and the like stay float32: the thin layers), 1.9x (v1) to 3.0x (v3) faster, its mel within cosine
      0.99999 of float32. Without native bfloat16 the products are emulated: float32.
    - LLM: at batch 1 bound by reading its weights; INT8 (dynamic, Linear layers, a quarter of float32's bytes) was
      1.85-2.0x faster than the oneDNN-packed float32 (2.0x too on the AVX2-only machine of the issue 3
      figures), bfloat16 slower than float32 (0.6-0.7x): INT8 on every CPU.
    - vocoder: float32. bfloat16 ran 1.4x faster for v1 (SNR 46 dB against float32; v3's causal vocoder 38 dB) but
      the vocoder is 7% of a float32 synthesis, and the v3 vocoder's sensitivity to bfloat16 is why the GPU path
      keeps it out of bfloat16; `dtype: bfloat16` forces it.
    A stage below MIN_REDUCED_PRECISION_PARAMETERS stays float32: it is bound by per-operation overhead, where
    reduced precision only adds casts and quantize calls (the tiny presets and kits).
    """
    f32, bf16 = torch.float32, torch.bfloat16
    big = {stage: sizes.get(stage, 0) >= MIN_REDUCED_PRECISION_PARAMETERS for stage in ("llm", "flow", "hift")}
    if not big["flow"]:
        flow, why_flow = f32, "flow float32 (too small for bfloat16 to pay)"
    elif caps.native_bfloat16:
        unit = "AMX" if caps.amx else "AVX512-BF16"
        flow, why_flow = bf16, f"flow bfloat16 (native on {unit})"
    else:
        flow, why_flow = f32, "flow float32 (no native bfloat16: neither AMX nor AVX512-BF16)"
    if llm_int4:
        llm_quantization, why_llm = "int4", "LLM INT4 weights, INT8 where the int4 kernel takes no layer (as asked)"
    elif big["llm"]:
        llm_quantization, why_llm = "int8", "LLM INT8 (batch-1 decode reads its weights)"
    else:
        llm_quantization, why_llm = None, "LLM float32 (too small for INT8 to pay)"
    why = f"{why_llm}; {why_flow}; vocoder float32 (quality); CPU {caps.describe()}"
    return DecoderDtypes(f32, flow, f32, llm_quantization=llm_quantization, reason=why)


def decoder_dtypes(
    name: str,
    prefers_bfloat16: bool,
    device: torch.device,
    sizes: dict[str, int] | None = None,
    cpu: CpuCapabilities | None = None,
) -> DecoderDtypes:
    """The decoder modules' dtypes for a dtype name (see `parse_dtype`: all three in it) or `auto`.

    `auto` on CPU: `cpu_auto_choice` for this CPU (`cpu`, default the machine's) and the modules' `sizes`
    (`module_sizes`; without them float32); `auto-int4` the same with an INT4 LLM (CPU only). On a GPU: float16,
    except for a family that `prefers_bfloat16` (CosyVoice3) on a GPU with native bfloat16: its DiT flow overflows
    float16 (upstream issues report NaN audio from its float16 flow, the error growing layer by layer rather than at
    one op), so the flow, and the LLM (a Qwen2, trained in bfloat16; the official vLLM path runs it so), get
    bfloat16, which has float32's range. The vocoder keeps float16, whose 3 more mantissa bits matter there
    (measured on random-weight CosyVoice3 vocoders, the kit's and a released-size one: bfloat16 weights give ~18 dB
    less signal-to-error than float16; its overflow-prone ops run in float32 anyway). Without native bfloat16,
    CosyVoice3 runs in float16 and the NaN guard recomputes what overflows.
    """
    if name == AUTO_INT4_DTYPE:
        if device.type != "cpu":
            raise InvalidInputError(f"{AUTO_INT4_DTYPE} is for a CPU decoder (torch's int4 kernel here is a CPU one)")
        return cpu_auto_choice(cpu or cpu_capabilities(), sizes or {}, llm_int4=True)
    if name != AUTO_DTYPE:
        dtype = parse_dtype(name)
        return DecoderDtypes(dtype, dtype, dtype)
    if device.type == "cpu" and sizes is not None:
        return cpu_auto_choice(cpu or cpu_capabilities(), sizes)
    if device.type != "cuda":
        return DecoderDtypes(torch.float32, torch.float32, torch.float32, reason="float32 (no sizes given)")
    return gpu_auto_dtypes(prefers_bfloat16, torch.cuda.is_bf16_supported(including_emulation=False))


def gpu_auto_dtypes(prefers_bfloat16: bool, native_bfloat16: bool) -> DecoderDtypes:
    """`auto` on a GPU (see `decoder_dtypes`), for a GPU with or without native bfloat16 (compute capability 8.0 or
    later): what a deployment plan reads for a card it does not run on."""
    if prefers_bfloat16 and native_bfloat16:
        return DecoderDtypes(
            llm=torch.bfloat16,
            flow=torch.bfloat16,
            hift=torch.float16,
            reason="GPU with native bfloat16, a family whose flow overflows float16",
        )
    return DecoderDtypes(torch.float16, torch.float16, torch.float16, reason="GPU: float16")


FallbackListener = Callable[[str, bool], None]


class PrecisionFallbacks:
    """Requests whose reduced-precision output (flow mel, vocoder audio) was not finite and were recomputed in
    float32, counted by (stage, recovered); each is logged, and passed to the listeners (a metrics hook)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, bool]] = Counter()
        self._listeners: list[FallbackListener] = []

    def add_listener(self, listener: FallbackListener) -> Callable[[], None]:
        """Call `listener(stage, recovered)` on every fallback; returns the function that removes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def record(self, stage: str, recovered: bool) -> None:
        self.counts[stage, recovered] += 1
        if recovered:
            logger.warning("%s output was not finite in reduced precision; recomputed in float32", stage)
        else:
            logger.error("%s output was not finite, in float32 too; the request fails", stage)
        for listener in list(self._listeners):
            listener(stage, recovered)


FALLBACKS = PrecisionFallbacks()  # the process's: one decoder per replica process


def recompute_non_finite(
    stage: str,
    outputs: list[Tensor],
    weight_dtype: torch.dtype,
    recompute: Callable[[int], Tensor],
    inputs: list[Tensor] | None = None,
) -> list[Tensor]:
    """The NaN guard of a batch computed with `weight_dtype` weights: every output that is not finite is replaced
    by `recompute(i)` run in `float32_compute()`, and counted in FALLBACKS. An output that float32 leaves
    non-finite stays so (the stages then fail that request with NonFiniteOutputError, the batch goes on). Nothing
    is recomputed when the batch already ran in float32, or for an item whose `inputs[i]` is not finite."""
    if layers.compute_dtype(weight_dtype) == torch.float32 or not outputs:
        return outputs
    finite = torch.stack([torch.isfinite(output).all() for output in outputs]).tolist()
    if all(finite):
        return outputs
    outputs = list(outputs)
    for index in (i for i, ok in enumerate(finite) if not ok):
        if inputs is not None and not bool(torch.isfinite(inputs[index]).all()):
            continue
        with layers.float32_compute():
            outputs[index] = recompute(index)
        FALLBACKS.record(stage, recovered=bool(torch.isfinite(outputs[index]).all()))
    return outputs


def parameter_bytes(module: nn.Module) -> int:
    """Bytes held by parameters and buffers, counting packed INT8 Linear weights too."""
    total = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    for child in module.modules():
        if isinstance(child, quantized_dynamic.Linear):
            weight, bias = child._packed_params._weight_bias()
            total += weight.numel() * weight.element_size()
            total += 0 if bias is None else bias.numel() * bias.element_size()
        if isinstance(child, layers.PackedLinear):
            total += child.packed_weight.numel() * child.packed_weight.element_size()
    return total


def _as_plain_linear(layer: layers.Linear) -> nn.Linear:
    plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    plain.weight = layer.weight
    plain.bias = layer.bias
    return plain


def _untied_linear_layers(module: nn.Module) -> list[tuple[nn.Module, str, layers.Linear]]:
    """(parent, name, layer) of every `layers.Linear` in `module` whose weight no other parameter shares.

    A layer tied to another parameter (CosyVoice2/3's unused text `lm_head`, tied to the token embedding) is left
    out: a packed or quantized copy would hold its weight twice.
    """
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    return [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, layers.Linear) and uses[id(child.weight)] == 1
    ]


def quantize_linear_int8(module: nn.Module) -> nn.Module:
    """Dynamic INT8 quantization of every untied Linear layer, in place; for CPU execution in float32.

    torch's dynamic quantization only converts exact `nn.Linear`, so the dtype-casting
    `layers.Linear` (a no-op in fp32) is swapped for a plain one first; tied layers keep their class and so their
    shared float32 weight.
    """
    if any(p.dtype != torch.float32 for p in module.parameters()):
        raise InvalidInputError("INT8 quantization needs a float32 module (it runs on CPU)")
    for parent, name, child in _untied_linear_layers(module):
        setattr(parent, name, _as_plain_linear(child))
    with warnings.catch_warnings():  # torch marks eager quantization deprecated; it still works in 2.14
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8, inplace=True)


# Inputs per INT4 scale and offset: 32 for accuracy (64 and 128 ran ~8% faster on layers of v1's shapes, 2 threads,
# with two and four times the weights per scale)
INT4_GROUP_SIZE = 32
# Bytes per quantized weight: INT8 one byte; INT4 half a byte, plus a bfloat16 scale and offset per group
QUANTIZED_WEIGHT_BYTES = {"int8": 1.0, "int4": 0.5 + 4 / INT4_GROUP_SIZE}


def int4_kernel_takes(layer: layers.Linear, group_size: int = INT4_GROUP_SIZE) -> bool:
    """Whether torch's packed int4 kernel takes the layer: outputs a multiple of 16, inputs in whole groups."""
    return layer.out_features % 16 == 0 and layer.in_features % group_size == 0


def quantize_linear_int4(module: nn.Module, group_size: int = INT4_GROUP_SIZE) -> nn.Module:
    """Weight-only INT4 (`layers.Int4Linear`) for every untied Linear layer the packed kernel takes, dynamic INT8 for
    the others (a speech-token head of 4097 or 6564 outputs), in place; for CPU execution in float32."""
    if any(p.dtype != torch.float32 for p in module.parameters()):
        raise InvalidInputError("INT4 quantization needs a float32 module (it runs on CPU)")
    for parent, name, child in _untied_linear_layers(module):
        if int4_kernel_takes(child, group_size):
            setattr(parent, name, layers.Int4Linear(child.weight, child.bias, group_size))
    return quantize_linear_int8(module)


def cpu_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_linear_for_cpu(module: nn.Module) -> nn.Module:
    """Swap every untied float32 CPU `layers.Linear` for a oneDNN-packed `layers.PackedLinear`, in place.

    The same products (within float rounding) at a fraction of the cost for the few rows of batched decode
    steps. Inference only: afterwards casts and `.to()` leave those weights as they are. A no-op where torch has
    no oneDNN.
    """
    if not cpu_packing_available():
        return module
    for parent, name, child in _untied_linear_layers(module):
        if child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
            setattr(parent, name, layers.PackedLinear(child.weight, child.bias))
    return module
