"""Numerical parity of engine.vocoder.hift's `HiFTGenerator` with the official one, on every hift case of the v1 kit
(`SineGen` source, 22.05 kHz) and of the v2 kit (`SineGen2`, 24 kHz). What only v2 has: test_parity_hift_v2.py;
CosyVoice3's causal HiFT: test_parity_hift_v3.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from engine.loading.loader import load_module
from engine.vocoder.hift import HiFTGenerator, Sine2Draws, SineDraws
from tests.conftest import kit_group, kit_model_version

# Kit README acceptance: f0 rtol 1e-5; speech atol 1e-4 (v1), 5e-4 (v2: exp magnitudes, three upsampling stages);
# hidden tensors atol 5e-5. conv_post_out feeds exp() directly and reaches ~10, so it gets the speech tolerance.
F0_RTOL, F0_ATOL = 1e-5, 1e-4
SPEECH_ATOL = {1: 1e-4, 2: 5e-4}
HIDDEN_ATOL = 5e-5
# The source is tanh of sines whose phase is a long float32 prefix sum: expect small phase differences.
SOURCE_ATOL = 1e-3
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
def hift_cases(kit: Path) -> list[dict[str, Any]]:
    return kit_group(torch.load(kit / "cases.pt", weights_only=True), "hift")


def test_f0_matches_official(hift: HiFTGenerator, hift_cases: list[dict[str, Any]]) -> None:
    for case in hift_cases:
        with torch.inference_mode():
            f0 = hift.predict_f0(case["mel"])
        assert_close(f0, case["f0"], atol=F0_ATOL, rtol=F0_RTOL, what=f"{case['name']} f0")


def test_decode_matches_official_speech_and_intermediates(
    hift: HiFTGenerator, hift_cases: list[dict[str, Any]], version: int
) -> None:
    captured: dict[str, Tensor] = {}
    hooks = [
        hift.conv_pre.register_forward_hook(lambda _m, _i, out: captured.update(conv_pre_out=out)),
        hift.source_downs[0].register_forward_pre_hook(lambda _m, inputs: captured.update(s_stft=inputs[0])),
        hift.conv_post.register_forward_hook(lambda _m, _i, out: captured.update(conv_post_out=out)),
    ]
    tolerances = {"conv_pre_out": HIDDEN_ATOL, "s_stft": HIDDEN_ATOL, "conv_post_out": SPEECH_ATOL[version]}
    try:
        for case in hift_cases:
            captured.clear()
            with torch.inference_mode():
                speech = hift.decode(case["mel"], case["source"])
            assert_close(speech, case["speech"], atol=SPEECH_ATOL[version], what=f"{case['name']} speech")
            assert speech.abs().max() <= case["audio_limit"]
            compared = [key for key in tolerances if key in case]
            assert "conv_pre_out" in compared
            for key in compared:
                assert_close(captured[key], case[key], atol=tolerances[key], what=f"{case['name']} {key}")
    finally:
        for hook in hooks:
            hook.remove()


def test_source_from_recorded_draws_matches_official(
    hift: HiFTGenerator, hift_cases: list[dict[str, Any]], version: int
) -> None:
    replayable = [case for case in hift_cases if case["rand_draw_order"]]
    if not replayable:
        pytest.skip("this kit records no HiFT random draws")
    order, draws = OFFICIAL_DRAW_ORDER[version]
    for case in replayable:
        assert case["rand_draw_order"].split(",") == order, case["name"]
        with torch.inference_mode():
            source = hift.source_from_draws(case["f0"], draws(case["rand_draw_0"], case["rand_draw_1"]))
        assert_close(with_cache_source(source, case), case["source"], atol=SOURCE_ATOL, what=f"{case['name']} source")
