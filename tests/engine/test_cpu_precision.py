"""`dtype: auto` on CPU: the CPU's units read from /proc/cpuinfo, the per-stage choice for faked CPUs and
model sizes, and the loader applying it (INT8 decoder LLM, bfloat16 flow, float32 vocoder and text encoder)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.ao.nn.quantized import dynamic as quantized_dynamic

from engine.loading.loader import load_model
from engine.nn import precision
from engine.nn.layers import Linear, PackedLinear
from engine.nn.precision import (
    CpuCapabilities,
    DecoderDtypes,
    cpu_auto_choice,
    decoder_dtypes,
    gemm_parameters,
    parse_cpuinfo,
)

CPU = torch.device("cpu")
F32, BF16 = torch.float32, torch.bfloat16
AMX = CpuCapabilities(frozenset({"amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx2"}), "AVX512")
ZEN4 = CpuCapabilities(frozenset({"avx512_bf16", "avx512_vnni", "avx512f", "avx2"}), "AVX512", "AMD EPYC")
AVX2 = CpuCapabilities(frozenset({"avx2"}), "AVX2")
REAL_SIZE = {"llm": 280_000_000, "flow": 100_000_000, "hift": 20_000_000}  # v1's GEMM weights (dummy preset)
TINY = {"llm": 180_000, "flow": 350_000, "hift": 110_000}

CPUINFO = """processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags		: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16

processor	: 1
model name	: another
flags		: fpu
"""


def test_cpuinfo_flags_model_and_vendor_of_the_first_processor() -> None:
    flags, model, vendor = parse_cpuinfo(CPUINFO)
    assert flags == {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
    assert model == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert vendor == "GenuineIntel"
    caps = CpuCapabilities(flags, "AVX512", model)
    assert caps.amx and caps.native_bfloat16
    assert "amx_bf16" in caps.describe() and "8481C" in caps.describe()
    assert parse_cpuinfo("") == (frozenset(), "", "")


@pytest.mark.parametrize(("caps", "unit"), [(AMX, "AMX"), (ZEN4, "AVX512-BF16")])
def test_native_bfloat16_gives_a_real_size_flow_bfloat16_and_the_llm_int8(caps: CpuCapabilities, unit: str) -> None:
    choice = cpu_auto_choice(caps, REAL_SIZE)
    assert choice == DecoderDtypes(F32, BF16, F32, llm_quantization="int8")
    assert choice.describe() == {"llm": "int8", "flow": "bfloat16", "hift": "float32"}
    assert unit in choice.reason and "LLM INT8" in choice.reason


def test_without_native_bfloat16_the_flow_stays_float32() -> None:
    choice = cpu_auto_choice(AVX2, REAL_SIZE)
    assert choice == DecoderDtypes(F32, F32, F32, llm_quantization="int8")
    assert "no native bfloat16" in choice.reason


@pytest.mark.parametrize("caps", [AMX, ZEN4, AVX2])
def test_tiny_models_stay_float32_on_every_cpu(caps: CpuCapabilities) -> None:
    choice = cpu_auto_choice(caps, TINY)
    assert choice == DecoderDtypes(F32, F32, F32)
    assert "too small" in choice.reason


def test_auto_on_cpu_goes_through_the_cpu_choice_and_a_named_dtype_is_forced() -> None:
    assert decoder_dtypes("auto", False, CPU, REAL_SIZE, cpu=AMX) == cpu_auto_choice(AMX, REAL_SIZE)
    assert decoder_dtypes("auto", False, CPU) == DecoderDtypes(F32, F32, F32)  # no sizes: float32
    for name, dtype in (("float32", F32), ("bf16", BF16)):
        assert decoder_dtypes(name, False, CPU, REAL_SIZE, cpu=AMX) == DecoderDtypes(dtype, dtype, dtype)


def test_gemm_parameters_count_linear_and_conv_weights_only() -> None:
    module = nn.Sequential(nn.Embedding(1000, 8), Linear(8, 4), nn.Conv1d(4, 2, 3), nn.LayerNorm(2))
    assert gemm_parameters(module) == 8 * 4 + 4 * 2 * 3
    assert gemm_parameters(PackedLinear(torch.randn(5, 3), None)) == 15
    assert gemm_parameters(None) == 0


def test_the_tiny_preset_loads_in_float32_with_auto() -> None:
    model = load_model("tiny", dtype="auto")
    assert model.precision == DecoderDtypes(F32, F32, F32)
    assert {p.dtype for m in (model.llm, model.flow, model.hift) for p in m.parameters()} == {F32}


def test_the_loader_applies_the_cpu_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AMX CPU and a size bound of 0 (so the tiny preset counts as big): INT8 decoder LLM with the text encoder
    left float32 in its own copy, bfloat16 flow, float32 vocoder, and the choice recorded on the model."""
    monkeypatch.setattr(precision, "cpu_capabilities", lambda: AMX)
    monkeypatch.setattr(precision, "MIN_REDUCED_PRECISION_PARAMETERS", 0)
    model = load_model("tiny", dtype="auto")
    assert model.precision == DecoderDtypes(F32, BF16, F32, llm_quantization="int8")
    assert "AMX" in model.precision.reason
    assert any(isinstance(m, quantized_dynamic.Linear) for m in model.llm.modules())
    assert not any(isinstance(m, quantized_dynamic.Linear) for m in model.text_llm.modules())
    assert {p.dtype for p in model.flow.parameters()} == {BF16}
    assert {p.dtype for p in model.hift.parameters()} == {F32}
