"""CosyVoice3 in reduced precision: the `auto` decoder dtype per version, float32 compute from low-precision
weights, a long input through the v3 flow and vocoder in bfloat16, and the NaN guard that recomputes a request's
non-finite flow mel or audio in float32 (or lets that request alone fail with NonFiniteOutputError)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm

from engine.errors import InvalidInputError, NonFiniteOutputError
from engine.families.base import ModelConfig
from engine.flow.dit import CausalMaskedDiffWithDiT, DiTFlowConfig
from engine.flow.masked_diff import FlowRequest
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import PRESETS_DIR, load_model
from engine.nn.layers import Conv1d, Linear, compute_dtype, float32_compute
from engine.nn.precision import DTYPES, FALLBACKS, DecoderDtypes, decoder_dtypes
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.segment import EncodedSegment
from engine.vocoder.causal_hift import CausalHiFTConfig, CausalHiFTGenerator
from tests.conftest import strictly_loaded, v3_kit_cases, v3_kit_dir, v3_yaml

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
LONG_TOKENS = 750  # 30 s of speech at 25 tokens per second


@pytest.fixture(scope="module")
def kit() -> Path:
    return v3_kit_dir()


@pytest.fixture
def fallbacks() -> Iterator[list[tuple[str, bool]]]:
    """The (stage, recovered) fallbacks recorded while the test runs, through the listener hook."""
    events: list[tuple[str, bool]] = []
    remove = FALLBACKS.add_listener(lambda stage, recovered: events.append((stage, recovered)))
    yield events
    remove()


def kit_flow(kit: Path, dtype: torch.dtype) -> CausalMaskedDiffWithDiT:
    flow = CausalMaskedDiffWithDiT(DiTFlowConfig.from_yaml(v3_yaml(kit)["flow"]))
    return strictly_loaded(flow, kit, "flow").to(dtype)


def kit_hift(kit: Path, dtype: torch.dtype) -> CausalHiFTGenerator:
    hift = CausalHiFTGenerator(CausalHiFTConfig.from_yaml(v3_yaml(kit)["hift"]))
    return strictly_loaded(hift, kit, "hift").to(dtype)


def whole_flow_requests(kit: Path) -> list[FlowRequest]:
    """The kit's non-streaming flow cases (one batch may mix only one mode)."""
    cases = [case for case in v3_kit_cases(kit)["flow"] if case["finalize"] and not case["streaming"]]
    return [
        FlowRequest(case["token"][0], case["prompt_token"][0], case["prompt_feat"][0], case["embedding"][0])
        for case in cases
    ]


@contextmanager
def poisoned_row(module: nn.Module, row: int, *, in_float32_too: bool) -> Iterator[None]:
    """While in the block, `module` writes NaN into its output's batch row `row`: at reduced precision only, as an
    overflow would, or in float32 compute too (a failure that precision cannot fix)."""

    def hook(_module: nn.Module, _args: tuple, output: Tensor) -> Tensor | None:
        if not in_float32_too and compute_dtype(torch.bfloat16) == torch.float32:
            return None
        output = output.clone()
        output[row] = float("nan")
        return output

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def relative_rms(actual: Tensor, expected: Tensor) -> float:
    return float((actual.float() - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())


def test_auto_dtypes_per_family(monkeypatch: pytest.MonkeyPatch) -> None:
    float32, float16, bfloat16 = (DecoderDtypes(dtype, dtype, dtype) for dtype in DTYPES.values())
    for prefers_bfloat16 in (False, True):
        assert decoder_dtypes("auto", prefers_bfloat16, CPU) == float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert decoder_dtypes("auto", False, CUDA) == float16
    assert decoder_dtypes("auto", True, CUDA) == DecoderDtypes(
        llm=torch.bfloat16, flow=torch.bfloat16, hift=torch.float16
    )
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert decoder_dtypes("auto", True, CUDA) == float16  # no native bfloat16: float16 and the NaN guard
    assert decoder_dtypes("bf16", True, CUDA) == bfloat16
    with pytest.raises(InvalidInputError, match="unknown dtype"):
        decoder_dtypes("float8", True, CPU)
    model = load_model("cosyvoice3-tiny", dtype="auto", components=("decoder",))
    assert model.dtype == torch.float32 and model.hift.conv_pre.bias.dtype == torch.float32


def test_float32_compute_from_low_precision_weights() -> None:
    torch.manual_seed(0)
    linear = Linear(16, 8).to(torch.bfloat16)
    conv = weight_norm(Conv1d(4, 6, 3)).to(torch.bfloat16)
    x, signal = torch.randn(5, 16), torch.randn(2, 4, 10)
    out = linear(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x.bfloat16(), linear.weight, linear.bias))
    assert torch.equal(conv(signal), F.conv1d(signal.bfloat16(), conv.weight, conv.bias))
    with float32_compute():
        assert compute_dtype(torch.bfloat16) == torch.float32
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight.float(), linear.bias.float()))
        torch.testing.assert_close(conv(signal), F.conv1d(signal, conv.weight.float(), conv.bias.float()))
    assert compute_dtype(torch.bfloat16) == torch.bfloat16 and linear.weight.dtype == torch.bfloat16


def test_reduced_precision_stays_close_to_float32(kit: Path) -> None:
    """The kit's flow in bfloat16 and its vocoder in float16 against float32 (measured: 0.4% and 4% RMS); the
    vocoder in bfloat16 errs more (measured: 28-31%), which is why `auto` keeps it in float16. The vocoder runs on
    the float32 mel and source, so that only its own precision counts (a different f0 drifts the phase)."""
    requests = whole_flow_requests(kit)
    mels = kit_flow(kit, torch.float32).inference(requests)
    for mel, reduced in zip(mels, kit_flow(kit, torch.bfloat16).inference(requests), strict=True):
        assert reduced.dtype == torch.float32 and relative_rms(reduced, mel) < 0.02
    vocoders = {dtype: kit_hift(kit, dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)}
    reference = vocoders[torch.float32]
    for mel in mels:
        with torch.inference_mode():
            f0 = reference.f0_predictor(mel[None])
            source = reference.source_from_draws(f0, reference.fixed_source_draws(f0.shape[1] * reference.config.hop))
            speech = {dtype: hift.decode(mel[None].to(dtype), source) for dtype, hift in vocoders.items()}
        error = {dtype: relative_rms(speech[dtype], speech[torch.float32]) for dtype in (torch.float16, torch.bfloat16)}
        assert error[torch.float16] < 0.1 and error[torch.float16] < error[torch.bfloat16]


def test_long_input_stays_finite_in_the_gpu_dtypes(monkeypatch: pytest.MonkeyPatch, fallbacks: list) -> None:
    """30 s of speech tokens through the released architecture (DiT and vocoder narrowed for CPU time) in the dtypes
    `auto` picks for CosyVoice3 on a bfloat16 GPU, run here on CPU: finite, with no float32 fallback."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    dtypes = decoder_dtypes("auto", True, CUDA)
    released = ModelConfig.from_yaml_file(PRESETS_DIR / "cosyvoice3-0.5b" / "cosyvoice3.yaml")
    estimator = dataclasses.replace(released.flow.estimator, depth=2, dim=256, heads=4)
    torch.manual_seed(0)
    flow = CausalMaskedDiffWithDiT(dataclasses.replace(released.flow, estimator=estimator)).eval().to(dtypes.flow)
    hift = CausalHiFTGenerator(dataclasses.replace(released.hift, base_channels=64)).eval().to(dtypes.hift)
    generator = torch.Generator().manual_seed(1)
    request = FlowRequest(
        tokens=torch.randint(0, released.flow.vocab_size, (LONG_TOKENS,), generator=generator),
        prompt_tokens=torch.zeros(0, dtype=torch.long),
        prompt_feat=torch.zeros(0, released.mel_bins),
        embedding=torch.randn(released.spk_embed_dim, generator=generator),
    )
    (mel,) = flow.inference([request], streaming=True, finalize=True)
    assert mel.shape == (released.mel_bins, 2 * LONG_TOKENS) and bool(torch.isfinite(mel).all())
    (speech,) = hift.inference([mel])
    assert speech.shape == (2 * LONG_TOKENS * hift.config.hop,) and bool(torch.isfinite(speech).all())
    assert float(speech.abs().max()) > 0
    assert fallbacks == []


def test_non_finite_flow_request_is_recomputed_in_float32(kit: Path, fallbacks: list) -> None:
    flow = kit_flow(kit, torch.bfloat16)
    requests = whole_flow_requests(kit)
    clean = flow.inference(requests)
    with poisoned_row(flow.decoder.estimator, 0, in_float32_too=False):
        guarded = flow.inference(requests)
    with float32_compute():
        (recomputed,) = flow.inference(requests[:1])
    assert bool(torch.isfinite(guarded[0]).all()) and torch.equal(guarded[0], recomputed)
    assert not torch.equal(guarded[0], clean[0])  # float32, not the bfloat16 result
    for alone, batched in zip(clean[1:], guarded[1:], strict=True):
        assert torch.equal(alone, batched)  # the other requests keep their batch result
    assert fallbacks == [("flow", True)]


def test_float16_overflow_is_recomputed_and_bfloat16_does_not_overflow(kit: Path, fallbacks: list) -> None:
    """A real overflow: with feed-forward outputs beyond float16's range (65504) the float16 flow gives NaN, which
    the guard recomputes in float32; bfloat16, with float32's range, gets through with no fallback."""
    requests = whole_flow_requests(kit)
    results = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        flow = kit_flow(kit, torch.float32)
        with torch.no_grad():
            for block in flow.decoder.estimator.transformer_blocks:
                block.ff.ff[2].weight.mul_(1e5)
        results[dtype] = flow.to(dtype).inference(requests)
        assert all(bool(torch.isfinite(mel).all()) for mel in results[dtype]), dtype
    assert fallbacks == [("flow", True)] * len(requests)  # all from float16
    for expected, actual in zip(results[torch.float32], results[torch.bfloat16], strict=True):
        assert relative_rms(actual, expected) < 0.05


def test_non_finite_audio_is_recomputed_in_float32(kit: Path, fallbacks: list) -> None:
    hift = kit_hift(kit, torch.bfloat16)
    mels = [case["mel"][0].bfloat16() for case in v3_kit_cases(kit)["hift"] if case["finalize"]]
    clean = hift.inference(mels)
    with poisoned_row(hift.conv_post, 0, in_float32_too=False):
        guarded = hift.inference(mels)
    with float32_compute():
        (recomputed,) = hift.inference(mels[:1])
    assert bool(torch.isfinite(guarded[0]).all()) and torch.equal(guarded[0], recomputed)
    assert all(torch.equal(alone, batched) for alone, batched in zip(clean[1:], guarded[1:], strict=True))
    assert fallbacks == [("vocoder", True)]


def test_float32_weights_are_not_recomputed(kit: Path, fallbacks: list) -> None:
    flow = kit_flow(kit, torch.float32)
    with poisoned_row(flow.decoder.estimator, 0, in_float32_too=True):
        mels = flow.inference(whole_flow_requests(kit))
    assert not bool(torch.isfinite(mels[0]).all()) and bool(torch.isfinite(mels[1]).all())
    assert fallbacks == []


def segments_of(kit: Path, decoder: SpeechDecoderStage) -> list[EncodedSegment]:
    """The kit's llm cases (text with <|endofprompt|>) as decoder input: greedy, the kit's speaker 0."""
    embedding = next(iter(torch.load(kit / "model" / "spk2info.pt", weights_only=True).values()))["embedding"]
    segments = []
    for case in v3_kit_cases(kit)["llm"][:2]:
        text = torch.cat([case["prompt_text"], case["text"]], dim=1).long()
        with torch.inference_mode():
            encoded = decoder.model.llm.encode_text(text, torch.tensor([text.shape[1]]))[0]
        segments.append(
            EncodedSegment(
                text_encoded=encoded.float().numpy(),
                text_len=case["text"].shape[1],
                llm_embedding=None,
                flow_embedding=embedding[0].numpy(),
                llm_prompt_speech_tokens=case["prompt_speech_token"][0].long().numpy(),
                flow_prompt_speech_tokens=np.zeros(0, dtype=np.int64),
                prompt_feat=np.zeros((0, 80), dtype=np.float32),
                sampling=SamplingOptions(greedy=True, seed=0, min_token_text_ratio=2.0, max_token_text_ratio=4.0),
                speed=1.0,
            )
        )
    return segments


def test_unrecoverable_request_fails_alone(kit: Path, fallbacks: list) -> None:
    """NaN that float32 does not fix either: that request's result is a NonFiniteOutputError, the other's audio."""
    decoder = SpeechDecoderStage(load_model(kit / "model", dtype="bfloat16", components=("decoder",)))
    segments = segments_of(kit, decoder)
    with poisoned_row(decoder.model.flow.decoder.estimator, 0, in_float32_too=True):
        results: list[Any] = decoder.decode_batch(segments)
    assert isinstance(results[0], NonFiniteOutputError)
    assert isinstance(results[1], np.ndarray) and results[1].size and np.isfinite(results[1]).all()
    assert fallbacks == [("flow", False)]  # the vocoder does not retry a non-finite mel
