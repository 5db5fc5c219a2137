"""The measuring pieces of benchmarks/roofline.py: FLOP counting, the layers a decode step reads, and a whole run on
the tiny model (medians with their spread; an efficiency above 1 is a failed measurement)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from benchmarks import roofline
from benchmarks.engine_bench import fixed_length_segments
from benchmarks.roofline import counted_flops, per_token_linears
from engine.loading.loader import load_model
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage


def test_counted_flops_include_the_cpu_attention_kernel() -> None:
    batch, heads, frames, head_dim = 2, 4, 30, 16
    q, k, v = (torch.randn(batch, heads, frames, head_dim) for _ in range(3))
    # scores and weighted values: two [frames x head_dim x frames] products per head, 2 FLOPs per multiply-add
    assert counted_flops(F.scaled_dot_product_attention, q, k, v) == 4 * batch * heads * frames**2 * head_dim
    x, w = torch.randn(5, 7), torch.randn(3, 7)
    assert counted_flops(F.linear, x, w) == 2 * 5 * 7 * 3


@pytest.mark.parametrize("int8", [False, True])
def test_a_decode_step_reads_the_backbone_and_output_layer_only(int8: bool) -> None:
    model = load_model("tiny", int8=int8)
    segments = fixed_length_segments(TextEncoderStage(model), 0.2)
    request = SpeechDecoderStage(model).generation_requests(segments)[0]

    layers = per_token_linears(model.llm, request)

    backbone = model.llm.llm
    expected = [backbone.embed.out[0]]
    for block in backbone.encoders:
        attention = block.self_attn
        expected += [attention.linear_q, attention.linear_k, attention.linear_v, attention.linear_out]
        expected += [block.feed_forward.w_1, block.feed_forward.w_2]
    expected.append(model.llm.llm_decoder)
    # the cached position projection, the speaker and text-encoder layers run once per request, not per token
    assert layers == expected


def test_a_cosyvoice3_decode_step_reads_the_qwen2_layers_and_speech_decoder_only() -> None:
    model = load_model("cosyvoice3-tiny")
    segments = fixed_length_segments(TextEncoderStage(model), 0.2)
    request = SpeechDecoderStage(model).generation_requests(segments)[0]

    layers = per_token_linears(model.llm, request)

    expected = []
    for layer in model.llm.llm.model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        expected += [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
        expected += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    expected.append(model.llm.llm_decoder)
    # not the text lm_head (tied to the embedding, never run)
    assert layers == expected


def _tiny_roofline() -> dict:
    return roofline.run("tiny", 0.2, threads=1, int8=False, repeats=2, warmup=1, gemm_seconds_per_shape=0.02)


def test_roofline_reports_medians_with_their_spread_and_bounded_efficiencies() -> None:
    result = _tiny_roofline()

    json.dumps(result, allow_nan=False)
    assert result["rtf_spread"]["min"] <= result["rtf"] <= result["rtf_spread"]["max"]
    assert result["gemm_gflops"]["1024x1024x1024_spread"]["n"] == 2
    assert result["stages"]["llm"]["read_gb_per_s_spread"]["n"] == roofline.READ_REPEATS
    failed = {entry["name"] for entry in result["failed_measurements"]}
    for name, stage in result["stages"].items():
        assert stage["seconds_spread"]["n"] == 2
        # a stage faster than its floor is reported as failed, never as an efficiency above 1
        assert (stage["efficiency"] is None) == (f"stages.{name}.efficiency" in failed)
        assert stage["efficiency"] is None or 0 < stage["efficiency"] <= 1


def test_an_efficiency_above_one_is_a_failed_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    # a GEMM peak measured far too low puts the flow's and HiFT's floors above their measured times
    monkeypatch.setattr(roofline, "peak_gemm_gflops", lambda *args: ({"peak": 1e-3}, 1e-3))

    result = _tiny_roofline()

    assert result["stages"]["flow"]["efficiency"] is None and result["efficiency"] is None
    failed = {entry["name"]: entry for entry in result["failed_measurements"]}
    assert {"stages.flow.efficiency", "stages.hift.efficiency", "efficiency"} <= set(failed)
    assert failed["efficiency"]["value"] > 1 and failed["efficiency"]["bound"] == [0.0, 1.0]
    assert result["stages"]["llm"]["efficiency"] is not None  # its floor is the weight read, not the GEMM peak
