"""Parity of the CosyVoice3 causal vocoder (`CausalHiFTGenerator`) with the official one, on the v3 kit (cases of up
to 120 frames), stage by stage, each fed the official tensor before it, with tolerances from the official code's
recorded spread (tests/parity/hift_pipeline.py).

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
from tests.conftest import kit_reference_sets, v3_kit_dir, v3_yaml
from tests.parity.hift_pipeline import (
    assert_pipeline,
    assert_stages_to_the_float32_floor,
    e2e_speech_tolerance,
    fused_snake,
    require_spread_fields,
    same_kind_cases,
    teacher_forced,
)

# f0 (Hz) comes before any recorded spread (the kit records f0, not its spread): float32 against the official
# float64 predictor (1.8e-6 measured).
F0_ATOL = 1e-4
BATCH_ATOL = 5e-5  # batched convolutions may pick other algorithms


@pytest.fixture(scope="module")
def kit() -> Path:
    return v3_kit_dir()


@pytest.fixture(scope="module")
def reference_sets(kit: Path) -> dict[str, list[dict[str, Any]]]:
    """The kit's hift cases and those of its other CPU kinds' references (`kit_reference_sets`)."""
    sets = kit_reference_sets(kit, "hift")
    assert sets, "the kit has no hift cases"
    for cases in sets.values():
        require_spread_fields(cases, kit)
    return sets


@pytest.fixture(scope="module")
def hift_cases(reference_sets: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every reference case, whatever CPU recorded it."""
    cases = [case for cases in reference_sets.values() for case in cases]
    assert any(not case["finalize"] for case in cases) and any(case["finalize"] for case in cases)
    return cases


@pytest.fixture(scope="module")
def hift(kit: Path) -> CausalHiFTGenerator:
    """Strictly loaded as the app loads it (`load_module`: the weight norm folded into plain weights)."""
    return load_module(kit / "model", "hift")


def decoder_mel(case: dict[str, Any]) -> torch.Tensor:
    """The mel the official inference() passes to decode(): without the f0 predictor's look-ahead frames."""
    return case["mel"] if case["finalize"] else case["mel"][:, :, :-F0_LOOKAHEAD]


def our_stages(hift: CausalHiFTGenerator, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Ours on the case's inputs, each stage fed the official tensor before it (`teacher_forced`): f0 of the mel;
    the sines of the recorded f0 and buffers, then the linear layer and tanh; decode of the mel without the f0
    look-ahead and the recorded source."""
    out: dict[str, torch.Tensor] = {}
    finalize = bool(case["finalize"])
    draws = FixedSourceDraws(case["source_initial_phase"], case["source_noise"])
    with torch.inference_mode():
        out["f0"] = hift.f0_predictor(case["mel"], finalize=finalize)
        with teacher_forced(hift, case, out):
            out["source"] = hift.source_from_draws(case["f0"].float(), draws)
            out["speech"] = hift.decode(decoder_mel(case), case["source"], finalize=finalize)
    return out


def test_each_stage_matches_official(hift: CausalHiFTGenerator, hift_cases: list[dict[str, Any]]) -> None:
    """f0, the source (sines, linear layer, tanh), conv_pre, conv_post, the magnitude and phase before the iSTFT,
    then the speech, each fed the official tensor before it, within the bound for a reference of another CPU kind
    (`hift_pipeline.tolerance`; what it catches and cannot: test_parity_hift.py)."""
    for case in hift_cases:
        actual = our_stages(hift, case)
        # ours keeps the padded width and zeros past the kept samples
        assert not actual["speech"][:, case["speech"].shape[1] :].any(), case["name"]
        compared = assert_pipeline(actual, case, fixed=f0_tolerance(case))
        expected = {"f0", "source_sine", "source_linear", "source", "conv_pre_out", "magnitude", "phase", "speech"}
        assert expected <= set(compared), case["name"]


def f0_tolerance(_case: dict[str, Any]) -> dict[str, float]:
    return {"f0": F0_ATOL}


def final_same_kind_cases(reference_sets: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The final chunks among the cases recorded on this machine's CPU kind. A chunk that is not final is left to the
    bound across CPU kinds: the official decode cuts conv_pre's look-ahead frames off before the upsampling stack,
    ours runs the stack over them too (so final and non-final chunks share a batch) and masks them after, and the
    longer tensors round otherwise (conv_post_out 1.3e-5 off, against a spread of 1.0e-4)."""
    return [case for case in same_kind_cases(reference_sets) if case["finalize"]]


def test_each_stage_matches_official_to_the_float32_floor_on_this_cpu_kind(
    hift: CausalHiFTGenerator, reference_sets: dict[str, list[dict[str, Any]]]
) -> None:
    """Against final chunks recorded on this machine's CPU kind, every stage within a few float32 ulps (what it
    catches and cannot: test_parity_hift.py)."""
    cases = final_same_kind_cases(reference_sets)
    assert_stages_to_the_float32_floor(lambda case: our_stages(hift, case), cases, f0_tolerance)


def test_the_float32_floor_sees_a_fused_snake(
    hift: CausalHiFTGenerator, reference_sets: dict[str, list[dict[str, Any]]]
) -> None:
    """The check above fails on the fused-Snake rounding bug (`hift_pipeline.fused_snake`)."""
    cases = final_same_kind_cases(reference_sets)
    with fused_snake(), pytest.raises(AssertionError, match=r"(conv_post_out|magnitude|phase), fed"):
        assert_stages_to_the_float32_floor(lambda case: our_stages(hift, case), cases, f0_tolerance)


def test_inference_from_the_mel_matches_official_speech(
    hift: CausalHiFTGenerator, hift_cases: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end, nothing fed: `inference` from the mel (f0 predicted, the source from the official fixed buffers
    the kit records in place of the model's own, decode), within `e2e_speech_tolerance` (what it catches and why it
    holds across CPU kinds: test_parity_hift.py, hift_pipeline.py)."""
    for case in hift_cases:

        def recorded_buffers(samples: int, start: int = 0, case: dict[str, Any] = case) -> FixedSourceDraws:
            return FixedSourceDraws(case["source_initial_phase"], case["source_noise"][:, start:samples])

        monkeypatch.setattr(hift, "fixed_source_draws", recorded_buffers)
        (speech,) = hift.inference([case["mel"][0]], finalize=bool(case["finalize"]))
        atol = e2e_speech_tolerance(case)
        torch.testing.assert_close(
            speech,
            case["speech"][0],
            atol=atol,
            rtol=0,
            msg=lambda message, case=case, atol=atol: (
                f"{case['name']}: speech from the mel (atol {atol:.2e}): {message}"
            ),
        )


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
