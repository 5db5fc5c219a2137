"""Parity of the CosyVoice3 causal vocoder (`CausalHiFTGenerator`) with the official one, on the v3 kit (cases of up
to 120 frames), tensor by tensor in pipeline order with tolerances from the official code's recorded spread
(tests/parity/hift_pipeline.py).

The official NSF source is deterministic but comes from buffers drawn at construction; the kit records them
(`source_initial_phase`, `source_noise`) and the resulting `source`, so the source and `decode` are checked on them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import CheckpointError, InvalidInputError
from engine.loading.loader import load_module
from engine.vocoder.causal_hift import F0_LOOKAHEAD, CausalHiFTConfig, CausalHiFTGenerator, FixedSourceDraws
from tests.conftest import v3_kit_cases, v3_kit_dir, v3_yaml
from tests.parity.hift_pipeline import assert_pipeline, captured_decode, captured_source

# f0 (Hz) comes before any recorded spread (the kit records f0, not its spread): float32 against the official
# float64 predictor (1.8e-6 measured).
F0_ATOL = 1e-4
BATCH_ATOL = 5e-5  # batched convolutions may pick other algorithms


@pytest.fixture(scope="module")
def kit() -> Path:
    return v3_kit_dir()


@pytest.fixture(scope="module")
def hift_cases(kit: Path) -> list[dict[str, Any]]:
    cases = v3_kit_cases(kit)["hift"]
    assert cases, "the kit has no hift cases"
    assert any(not case["finalize"] for case in cases) and any(case["finalize"] for case in cases)
    return cases


@pytest.fixture(scope="module")
def hift(kit: Path) -> CausalHiFTGenerator:
    """Strictly loaded as the app loads it (`load_module`: the weight norm folded into plain weights)."""
    return load_module(kit / "model", "hift")


def decoder_mel(case: dict[str, Any]) -> torch.Tensor:
    """The mel the official inference() passes to decode(): without the f0 predictor's look-ahead frames."""
    return case["mel"] if case["finalize"] else case["mel"][:, :, :-F0_LOOKAHEAD]


def our_pipeline(hift: CausalHiFTGenerator, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Ours on the case's inputs, as the kit maker ran the official code: f0 of the mel; the source from the recorded
    f0 and buffers (`source_sine`, `source_linear`: its linear layer's input and output); decode of the mel without
    the f0 look-ahead and the recorded source."""
    out: dict[str, torch.Tensor] = {}
    finalize = bool(case["finalize"])
    draws = FixedSourceDraws(case["source_initial_phase"], case["source_noise"])
    with torch.inference_mode():
        out["f0"] = hift.f0_predictor(case["mel"], finalize=finalize)
        with captured_source(hift, out):
            out["source"] = hift.source_from_draws(case["f0"].float(), draws)
        with captured_decode(hift, out):
            out["speech"] = hift.decode(decoder_mel(case), case["source"], finalize=finalize)
    return out


def test_pipeline_matches_official_in_order(hift: CausalHiFTGenerator, hift_cases: list[dict[str, Any]]) -> None:
    """f0, the source (sines, linear layer, tanh), conv_pre, conv_post, the magnitude and phase before the iSTFT,
    then the speech: the first tensor off the official one by more than its tolerance fails."""
    for case in hift_cases:
        actual = our_pipeline(hift, case)
        # ours keeps the padded width and zeros past the kept samples
        assert not actual["speech"][:, case["speech"].shape[1] :].any(), case["name"]
        compared = assert_pipeline(actual, case, fixed={"f0": F0_ATOL})
        expected = {"f0", "source_sine", "source_linear", "source", "conv_pre_out", "magnitude", "phase", "speech"}
        assert expected <= set(compared), case["name"]


def test_inference_lengths_and_batching(hift: CausalHiFTGenerator, hift_cases: list[dict[str, Any]]) -> None:
    """inference() gives the official number of samples, and batching items of different lengths changes nothing."""
    for finalize in (True, False):
        cases = [case for case in hift_cases if bool(case["finalize"]) == finalize]
        short = [case for case in hift_cases if case["mel"].shape[-1] < 30]  # the longer cases add time, not paths
        mels = [case["mel"][0] for case in short] + [hift_cases[0]["mel"][0, :, :12]]
        batched = hift.inference(mels, finalize=finalize)
        for mel, speech in zip(mels, batched, strict=True):
            (alone,) = hift.inference([mel], finalize=finalize)
            torch.testing.assert_close(speech, alone, atol=BATCH_ATOL, rtol=0)
        for case in cases:
            (speech,) = hift.inference([case["mel"][0]], finalize=finalize)
            assert speech.shape == case["speech"][0].shape, case["name"]


def test_fixed_source_draws_are_a_stable_prefix(hift: CausalHiFTGenerator) -> None:
    long, short = hift.fixed_source_draws(300_000), hift.fixed_source_draws(1000)
    assert torch.equal(long.noise[:, :1000], short.noise) and torch.equal(long.initial_phase, short.initial_phase)
    assert long.initial_phase[0, 0] == 0 and float(long.noise.min()) >= 0 and float(long.noise.max()) < 1


def test_streaming_chunk_too_short_is_a_clear_error(hift: CausalHiFTGenerator) -> None:
    with pytest.raises(InvalidInputError, match="T >= 9"):
        hift.inference([torch.zeros(hift.config.in_channels, 8)], finalize=False)


def test_config_rejects_the_v2_vocoder(kit: Path) -> None:
    spec = v3_yaml(kit)["hift"]
    spec.target = "cosyvoice.hifigan.generator.HiFTGenerator"
    with pytest.raises(CheckpointError, match="CausalHiFTGenerator"):
        CausalHiFTConfig.from_yaml(spec)
