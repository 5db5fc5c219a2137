"""Weight precision and layout: real fp16/bf16 casts, INT8 dynamic quantization and oneDNN-packed float32
Linear layers (both for CPU)."""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch import nn
from torch.ao.nn.quantized import dynamic as quantized_dynamic
from torch.ao.quantization import quantize_dynamic

from engine import layers
from engine.errors import InvalidInputError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    """'float32' / 'float16' / 'bfloat16' (also 'fp32', 'fp16', 'bf16') -> torch dtype."""
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    key = aliases.get(name, name)
    if key not in DTYPES:
        raise InvalidInputError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[key]


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


def quantize_linear_int8(module: nn.Module) -> nn.Module:
    """Dynamic INT8 quantization of every Linear layer, in place; for CPU execution in float32.

    torch's dynamic quantization only converts exact `nn.Linear`, so the dtype-casting
    `layers.Linear` (a no-op in fp32) is swapped for a plain one first.
    """
    if any(p.dtype != torch.float32 for p in module.parameters()):
        raise InvalidInputError("INT8 quantization needs a float32 module (it runs on CPU)")
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, layers.Linear):
                setattr(parent, name, _as_plain_linear(child))
    with warnings.catch_warnings():  # torch marks eager quantization deprecated; it still works in 2.14
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8, inplace=True)


def cpu_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_linear_for_cpu(module: nn.Module) -> nn.Module:
    """Swap every float32 CPU `layers.Linear` for a oneDNN-packed `layers.PackedLinear`, in place.

    The same products (within float rounding) at a fraction of the cost for the few rows of batched decode
    steps. Inference only: afterwards casts and `.to()` leave those weights as they are. Layers whose weight is
    tied to another parameter (CosyVoice2's unused text `lm_head`) are left alone, since packing would copy it.
    A no-op where torch has no oneDNN.
    """
    if not cpu_packing_available():
        return module
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            weight = child.weight if isinstance(child, layers.Linear) else None
            if (
                weight is not None
                and weight.dtype == torch.float32
                and weight.device.type == "cpu"
                and uses[id(weight)] == 1
            ):
                setattr(parent, name, layers.PackedLinear(weight, child.bias))
    return module
