"""Numerical parity of engine.vocoder.hift's `HiFTGenerator` with the official one, on every hift case of the v1 kit
(`SineGen` source, 22.05 kHz) and of the v2 kit (`SineGen2`, 24 kHz; cases of up to 120 frames), tensor by tensor in
pipeline order with tolerances from the official code's recorded spread (tests/parity/hift_pipeline.py). What only
v2 has: test_parity_hift_v2.py; CosyVoice3's causal HiFT: test_parity_hift_v3.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from engine.loading.loader import load_module
from engine.vocoder.hift import HiFTGenerator, Sine2Draws, SineDraws
from tests.conftest import kit_group, kit_model_version
from tests.parity.hift_pipeline import assert_pipeline, captured_decode, captured_source

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
def hift_cases(kit: Path) -> list[dict[str, Any]]:
    return kit_group(torch.load(kit / "cases.pt", weights_only=True), "hift")


def our_pipeline(hift: HiFTGenerator, case: dict[str, Any], version: int) -> dict[str, Tensor]:
    """Ours on the case's inputs, as the kit maker ran the official code: f0 of the mel; with recorded draws, the
    source from the recorded f0 and draws (`source_sine`, `source_linear` before tanh and the cache overwrite);
    decode of the recorded mel and source."""
    out: dict[str, Tensor] = {}
    with torch.inference_mode():
        out["f0"] = hift.predict_f0(case["mel"])
        if case["rand_draw_order"]:
            order, draws = OFFICIAL_DRAW_ORDER[version]
            assert case["rand_draw_order"].split(",") == order, case["name"]
            with captured_source(hift, out):
                source = hift.source_from_draws(case["f0"], draws(case["rand_draw_0"], case["rand_draw_1"]))
            out["source"] = with_cache_source(source, case)
        with captured_decode(hift, out):
            out["speech"] = hift.decode(case["mel"], case["source"])
    return out


def test_pipeline_matches_official_in_order(
    hift: HiFTGenerator, hift_cases: list[dict[str, Any]], version: int
) -> None:
    """f0, the source (sines, linear layer, tanh), the source spectrum, conv_pre, conv_post, the magnitude and phase
    before the iSTFT, then the speech: the first tensor off the official one by more than its tolerance fails."""
    for case in hift_cases:
        actual = our_pipeline(hift, case, version)
        compared = assert_pipeline(actual, case, fixed={"f0": F0_ATOL + F0_RTOL * float(case["f0"].abs().max())})
        assert {"f0", "conv_pre_out", "magnitude", "phase", "speech"} <= set(compared), case["name"]
        assert not case["rand_draw_order"] or {"source_sine", "source_linear", "source"} <= set(compared)
        assert actual["speech"].abs().max() <= case["audio_limit"]
