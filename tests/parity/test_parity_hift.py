"""Numerical parity of engine.vocoder.hift's `HiFTGenerator` with the official one, on every hift case of the v1 kit
(`SineGen` source, 22.05 kHz) and of the v2 kit (`SineGen2`, 24 kHz; cases of up to 120 frames), and of their
references recorded on other CPU kinds: stage by stage, each fed the official tensor before it, then end to end
from the mel, with tolerances from the official code's recorded spread (tests/parity/hift_pipeline.py). What only
v2 has: test_parity_hift_v2.py; CosyVoice3's causal HiFT: test_parity_hift_v3.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from engine.loading.loader import load_module
from engine.vocoder.hift import HiFTGenerator, Sine2Draws, SineDraws, SourceDraws
from tests.conftest import kit_model_version, kit_reference_sets
from tests.parity.hift_pipeline import (
    assert_pipeline,
    assert_stages_to_the_float32_floor,
    e2e_speech_tolerance,
    fused_snake,
    require_spread_fields,
    runs_end_to_end,
    same_kind_cases,
    teacher_forced,
)

# f0 comes before any recorded spread (the kit records f0, not its spread): the kit README's acceptance, rtol 1e-5.
F0_RTOL, F0_ATOL = 1e-5, 1e-4
# The official random draws of each source, in order (the third, the unused noise branch, is not replayed), and
# the draws object they make.
OFFICIAL_DRAW_ORDER = {
    1: (["Uniform.sample", "torch.randn_like", "torch.randn_like"], SineDraws),
    2: (["torch.rand", "torch.randn_like", "torch.randn_like"], Sine2Draws),
}


def assert_close(actual: Tensor, expected: Tensor, *, atol: float, rtol: float = 0.0, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda message: f"{what}: {message}")


def with_cache_source(source: Tensor, case: dict[str, Any]) -> Tensor:
    """The official `inference(speech_feat, cache_source)`: the cached source overwrites the first samples."""
    cached = case["cache_source"]
    source = source.clone()
    source[:, :, : cached.shape[-1]] = cached
    return source


@pytest.fixture(scope="module")
def kit(v1_v2_kit: Path) -> Path:
    return v1_v2_kit


@pytest.fixture(scope="module")
def version(kit: Path) -> int:
    return kit_model_version(kit)


@pytest.fixture(scope="module")
def hift(kit: Path) -> HiFTGenerator:
    """The kit's vocoder, strictly loaded from hift.pt (legacy weight-norm keys accepted), in eval mode."""
    return load_module(kit / "model", "hift")


@pytest.fixture(scope="module")
def reference_sets(kit: Path) -> dict[str, list[dict[str, Any]]]:
    """The kit's hift cases and those of its other CPU kinds' references (`kit_reference_sets`)."""
    sets = kit_reference_sets(kit, "hift")
    if not sets:
        pytest.skip("this conformance kit has no 'hift' cases")
    for cases in sets.values():
        require_spread_fields(cases, kit)
    return sets


def f0_tolerance(case: dict[str, Any]) -> dict[str, float]:
    return {"f0": F0_ATOL + F0_RTOL * float(case["f0"].abs().max())}


def our_stages(hift: HiFTGenerator, case: dict[str, Any], version: int) -> dict[str, Tensor]:
    """Ours on the case's inputs, each stage fed the official tensor before it (`teacher_forced`): f0 of the mel;
    with recorded draws, the sines of the recorded f0 and draws, then the linear layer, tanh and the cache
    overwrite; decode of the recorded mel and source."""
    out: dict[str, Tensor] = {}
    with torch.inference_mode():
        out["f0"] = hift.predict_f0(case["mel"])
        with teacher_forced(hift, case, out):
            if case["rand_draw_order"]:
                order, draws = OFFICIAL_DRAW_ORDER[version]
                assert case["rand_draw_order"].split(",") == order, case["name"]
                source = hift.source_from_draws(case["f0"], draws(case["rand_draw_0"], case["rand_draw_1"]))
                out["source"] = with_cache_source(source, case)
            out["speech"] = hift.decode(case["mel"], case["source"])
    return out


def test_each_stage_matches_official(
    hift: HiFTGenerator, reference_sets: dict[str, list[dict[str, Any]]], version: int
) -> None:
    """f0, the source (sines, linear layer, tanh), the source spectrum, conv_pre, conv_post, the magnitude and phase
    before the iSTFT, then the speech, each fed the official tensor before it, within the bound for a reference of
    another CPU kind (`hift_pipeline.tolerance`), against every reference the kit holds, whatever CPU recorded it.

    Catches a stage computed wrongly by more than the official code varies between machines (a wrong layer, order
    of operations that moves a tensor by more than 4 spreads, a broken cache overwrite); cannot catch a change of
    rounding order within a stage (a fused Snake moves conv_post by about one spread): the float32-floor test below
    does, on references of this machine's CPU kind."""
    for name, cases in reference_sets.items():
        for case in cases:
            actual = our_stages(hift, case, version)
            compared = assert_pipeline(actual, case, fixed=f0_tolerance(case))
            assert {"f0", "conv_pre_out", "magnitude", "phase", "speech"} <= set(compared), (name, case["name"])
            assert not case["rand_draw_order"] or {"source_sine", "source_linear", "source"} <= set(compared)
            assert actual["speech"].abs().max() <= case["audio_limit"]


def test_each_stage_matches_official_to_the_float32_floor_on_this_cpu_kind(
    hift: HiFTGenerator, reference_sets: dict[str, list[dict[str, Any]]], version: int
) -> None:
    """Against references recorded on this machine's CPU kind, every stage, fed the official tensor before it,
    within a few float32 ulps (`hift_pipeline.same_kind_tolerance`): our stages run the official kernels in the
    official order. Catches what the bound across CPU kinds cannot: a rounding-order change within a stage, such as
    Snake's product and sum rounded together (next test). Cannot be asked of references of another CPU kind, whose
    kernels round otherwise by as much."""
    assert_stages_to_the_float32_floor(
        lambda case: our_stages(hift, case, version), same_kind_cases(reference_sets), f0_tolerance
    )


def test_the_float32_floor_sees_a_fused_snake(
    hift: HiFTGenerator, reference_sets: dict[str, list[dict[str, Any]]], version: int
) -> None:
    """The check above fails on the fused-Snake rounding bug (`hift_pipeline.fused_snake`)."""
    cases = same_kind_cases(reference_sets)
    with fused_snake(), pytest.raises(AssertionError, match=r"(conv_post_out|magnitude|phase), fed"):
        assert_stages_to_the_float32_floor(lambda case: our_stages(hift, case, version), cases, f0_tolerance)


def test_inference_from_the_mel_matches_official_speech(
    hift: HiFTGenerator,
    reference_sets: dict[str, list[dict[str, Any]]],
    version: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end, nothing fed: f0 predicted from the recorded mel, the source from it with the recorded draws
    replayed (a case with a cache overwrites the source's head and decodes, as the streaming path does, else
    `inference`), within `e2e_speech_tolerance` (E2E_SPREAD_FACTOR x the official code's own end-to-end spread; why
    it holds across CPU kinds: hift_pipeline.py). Catches what feeding each stage cannot: the stages joined wrongly (f0
    upsampled or padded otherwise, the draws used in another order, the cache overwrite misplaced); cannot see a
    rounding change of a few ulps, which the end-to-end spread of 1e-6 to 1e-3 swamps."""
    sine_gen = hift.m_source.l_sin_gen
    order, draws_class = OFFICIAL_DRAW_ORDER[version]
    checked = 0
    for name, cases in reference_sets.items():
        for case in cases:
            if not runs_end_to_end(case):
                continue
            assert case["rand_draw_order"].split(",") == order, case["name"]
            recorded = draws_class(case["rand_draw_0"], case["rand_draw_1"])

            def replay(batch: int, length: int, *_: Any, recorded: SourceDraws = recorded) -> SourceDraws:
                assert (batch, length) == (
                    recorded.noise.shape[0],
                    recorded.noise.numel() // batch // sine_gen.harmonics,
                )
                return recorded

            monkeypatch.setattr(sine_gen, "draw", replay)
            with torch.inference_mode():
                if case["cache_source"].numel():
                    source = hift.make_source(hift.predict_f0(case["mel"]))
                    speech = hift.decode(case["mel"], with_cache_source(source, case))
                else:
                    speech = hift.inference([case["mel"][0]])[0][None]
            atol = e2e_speech_tolerance(case)
            torch.testing.assert_close(
                speech,
                case["speech"],
                atol=atol,
                rtol=0,
                msg=lambda message, name=name, case=case, atol=atol: (
                    f"{name} {case['name']}: speech from the mel (atol {atol:.2e}): {message}"
                ),
            )
            checked += 1
    assert checked, "no case records its random draws"
