"""Weight-only INT4 for the CPU LLM (`dtype: auto-int4`): the group quantization, the packed layer against the
dequantized product, which layers the kernel takes, the loader, and the CPU-only rule where the dtype is read."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from torch.ao.nn.quantized import dynamic as quantized_dynamic

from engine.errors import InvalidInputError
from engine.llm.generation import TokenGenerator
from engine.loading.loader import load_model
from engine.nn.layers import Int4Linear, Linear, int4_groups
from engine.nn.precision import (
    AUTO_INT4_DTYPE,
    QUANTIZED_WEIGHT_BYTES,
    DecoderDtypes,
    decoder_dtypes,
    quantize_linear_int4,
)
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.synthesis_request import SynthesisRequest
from serve_app.decoder_args import DecoderArgs

F32 = torch.float32


def dequantized(codes: torch.Tensor, scales_and_offsets: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weight the kernel multiplies by: (code - 8) * scale + offset, per group of `group_size` inputs."""
    scale, offset = (scales_and_offsets[..., i].float().transpose(0, 1) for i in (0, 1))
    return (codes.float() - 8) * scale.repeat_interleave(group_size, 1) + offset.repeat_interleave(group_size, 1)


def test_each_group_spreads_over_its_own_range_and_every_weight_lands_within_half_a_step() -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 0, 96)
    codes, scales_and_offsets = int4_groups(weight, 32)
    assert codes.shape == weight.shape and int(codes.min()) == 0 and int(codes.max()) == 15
    assert scales_and_offsets.shape == (3, 48, 2) and scales_and_offsets.dtype == torch.bfloat16
    step = scales_and_offsets[..., 0].float().transpose(0, 1).repeat_interleave(32, 1)
    error = (dequantized(codes, scales_and_offsets, 32) - weight).abs()
    # half a step, plus the bfloat16 rounding of the scale and offset (2^-8 of each)
    assert bool((error <= step / 2 + weight.abs().amax(dim=1, keepdim=True) * 2**-7).all())


@pytest.mark.parametrize("bias", [True, False])
def test_the_int4_layer_computes_the_dequantized_product_of_its_rows_in_bfloat16(bias: bool) -> None:
    torch.manual_seed(1)
    plain = nn.Linear(128, 64, bias=bias)
    layer = Int4Linear(plain.weight, plain.bias, 32)
    x = torch.randn(2, 5, 128)
    codes, scales_and_offsets = int4_groups(plain.weight.detach(), 32)
    expected = x.bfloat16().float() @ dequantized(codes, scales_and_offsets, 32).T
    if bias:
        expected = expected + plain.bias.detach()
    out = layer(x)
    assert out.shape == (2, 5, 64) and out.dtype == F32
    assert float((out - expected).abs().max()) < 1e-2 * float(expected.abs().max())
    # a cast of the module leaves the packed weight and its scales as the kernel reads them
    assert torch.equal(layer.to(F32)(x), out)


def test_the_layers_the_int4_kernel_takes_get_int4_the_others_int8_and_tied_ones_stay() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.square = Linear(64, 64)
            self.head = Linear(64, 4097)  # the v1 speech-token head: outputs not a multiple of 16
            self.embedding = nn.Embedding(10, 64)
            self.tied = Linear(64, 10, bias=False)
            self.tied.weight = self.embedding.weight

    model = quantize_linear_int4(Model())
    assert isinstance(model.square, Int4Linear)
    assert isinstance(model.head, quantized_dynamic.Linear)
    assert type(model.tied) is Linear and model.tied.weight is model.embedding.weight
    with pytest.raises(InvalidInputError, match="float32"):
        quantize_linear_int4(nn.Sequential(Linear(64, 64)).bfloat16())


def first_step_probabilities(model, text: str = "Hello there, this is a test.") -> torch.Tensor:
    """The probabilities the model's LLM gives the first speech token, greedy, for one sentence in its first voice."""
    [segment] = TextEncoderStage(model).encode(SynthesisRequest(text=text, voice=model.voices.names[0]))
    stage = SpeechDecoderStage(model)
    generator = TokenGenerator(model.llm)
    generator.add(stage.generation_requests([segment])[0])
    with torch.inference_mode():
        [event] = generator.step()
    return event.logprobs.float().exp()


def test_auto_int4_loads_an_int4_decoder_llm_beside_a_float32_text_encoder_and_stays_close_to_float32() -> None:
    model = load_model("tiny", dtype=AUTO_INT4_DTYPE)
    assert model.precision.llm_quantization == "int4" and model.precision.describe()["llm"] == "int4"
    assert "INT4" in model.precision.reason
    assert any(isinstance(m, Int4Linear) for m in model.llm.modules())
    assert not any(isinstance(m, (Int4Linear, quantized_dynamic.Linear)) for m in model.text_llm.modules())
    reference = load_model("tiny")
    ours, theirs = first_step_probabilities(model), first_step_probabilities(reference)
    assert float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0)) > 0.99


def test_auto_int4_is_for_cpu_decoders() -> None:
    with pytest.raises(InvalidInputError, match="CPU decoder"):
        decoder_dtypes(AUTO_INT4_DTYPE, False, torch.device("cuda"))
    with pytest.raises(ValidationError, match="auto-int4 is for CPU decoders"):
        DecoderArgs(dtype=AUTO_INT4_DTYPE, num_gpus=0.5)
    assert DecoderArgs(dtype=AUTO_INT4_DTYPE).dtype == AUTO_INT4_DTYPE


def test_an_int4_llm_weighs_five_eighths_of_a_byte_per_weight_in_the_plan() -> None:
    from engine.loading.loader import model_sizes

    sizes = model_sizes("tiny")
    int8 = sizes.weight_bytes(DecoderDtypes(F32, F32, F32, llm_quantization="int8"))
    int4 = sizes.weight_bytes(DecoderDtypes(F32, F32, F32, llm_quantization="int4"))
    assert QUANTIZED_WEIGHT_BYTES["int4"] == 0.625
    assert int8 - int4 == sizes.parameters["llm"] - int(sizes.parameters["llm"] * 0.625)
