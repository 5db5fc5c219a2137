"""Parity of the CosyVoice3 causal vocoder (`CausalHiFTGenerator`) with the official one, on the v3 kit.

The official NSF source is deterministic but comes from buffers drawn at construction; the kit records them
(`source_initial_phase`, `source_noise`) and the resulting `source`, so the source and `decode` are checked on them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import CheckpointError, InvalidInputError
from engine.vocoder.causal_hift import F0_LOOKAHEAD, CausalHiFTConfig, CausalHiFTGenerator, FixedSourceDraws
from tests.conftest import strictly_loaded, v3_kit_cases, v3_kit_dir, v3_yaml

ATOL = 1e-4  # speech, f0 (Hz) and the source
# conv_post: float32 rounding over ~30 convolutions grows with the values (up to ~20), so the bound is relative to
# each case's peak: 1.7e-5 of it was measured on an AVX-512 machine with one thread (2.07e-4 at a peak of 11.9).
CONV_POST_PEAK_FRACTION = 3e-5
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
    return strictly_loaded(CausalHiFTGenerator(CausalHiFTConfig.from_yaml(v3_yaml(kit)["hift"])), kit, "hift")


def decoder_mel(case: dict[str, Any]) -> torch.Tensor:
    """The mel the official inference() passes to decode(): without the f0 predictor's look-ahead frames."""
    return case["mel"] if case["finalize"] else case["mel"][:, :, :-F0_LOOKAHEAD]


def test_f0(hift: CausalHiFTGenerator, hift_cases: list[dict[str, Any]]) -> None:
    for case in hift_cases:
        with torch.inference_mode():
            f0 = hift.f0_predictor(case["mel"], finalize=bool(case["finalize"]))
        torch.testing.assert_close(f0, case["f0"].float(), atol=ATOL, rtol=0, msg=case["name"])


def test_source_from_recorded_draws(hift: CausalHiFTGenerator, hift_cases: list[dict[str, Any]]) -> None:
    for case in hift_cases:
        draws = FixedSourceDraws(case["source_initial_phase"], case["source_noise"])
        with torch.inference_mode():
            source = hift.source_from_draws(case["f0"].float(), draws)
        torch.testing.assert_close(source, case["source"], atol=ATOL, rtol=0, msg=case["name"])


def test_decode(hift: CausalHiFTGenerator, hift_cases: list[dict[str, Any]]) -> None:
    recorded: dict[str, torch.Tensor] = {}
    hooks = [
        getattr(hift, name).register_forward_hook(lambda _m, _a, out, name=name: recorded.__setitem__(name, out))
        for name in ("conv_pre", "conv_post")
    ]
    try:
        for case in hift_cases:
            name, finalize = case["name"], bool(case["finalize"])
            with torch.inference_mode():
                speech = hift.decode(decoder_mel(case), case["source"], finalize=finalize)
            reference = case["speech"]
            # ours keeps the padded width and zeros past the kept samples
            assert not speech[:, reference.shape[1] :].any(), name
            torch.testing.assert_close(speech[:, : reference.shape[1]], reference, atol=ATOL, rtol=0, msg=name)
            for key in ("conv_pre", "conv_post"):
                expected = case[f"{key}_out"]
                atol = ATOL if key == "conv_pre" else CONV_POST_PEAK_FRACTION * expected.abs().max().item()
                actual = recorded[key][..., : expected.shape[-1]]
                torch.testing.assert_close(actual, expected, atol=atol, rtol=0, msg=f"{name} {key}")
    finally:
        for hook in hooks:
            hook.remove()


def test_inference_lengths_and_batching(hift: CausalHiFTGenerator, hift_cases: list[dict[str, Any]]) -> None:
    """inference() gives the official number of samples, and batching items of different lengths changes nothing."""
    for finalize in (True, False):
        cases = [case for case in hift_cases if bool(case["finalize"]) == finalize]
        mels = [case["mel"][0] for case in hift_cases] + [hift_cases[0]["mel"][0, :, :12]]
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
