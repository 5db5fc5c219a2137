"""Parity of what only the CosyVoice2 HiFTGenerator (24 kHz, `SineGen2` source) has with the official one, on the v2 kit
(what v1 and v2 share, end to end from the mel included: test_parity_hift.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.vocoder.hift import HiFTGenerator, Sine2Draws, SineGen2
from tests.conftest import kit_group
from tests.parity.test_parity_hift import OFFICIAL_DRAW_ORDER, assert_close

BATCH_ATOL = 1e-4
# batched and single-row float32 kernels may round differently (seen: 3e-8 on the source)
ROUNDING_ATOL = 1e-6


@pytest.fixture(scope="module")
def hift_cases(v2_kit_cases: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return kit_group(v2_kit_cases, "hift")


@pytest.fixture(scope="module")
def replayable_cases(hift_cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cases = [case for case in hift_cases if case["rand_draw_order"]]
    if not cases:
        pytest.skip("this kit records no HiFT random draws")
    for case in cases:
        assert case["rand_draw_order"].split(",") == OFFICIAL_DRAW_ORDER[2][0]
    return cases


def _recorded_draws(case: dict[str, Any]) -> Sine2Draws:
    return Sine2Draws(case["rand_draw_0"], case["rand_draw_1"])


def test_kit_uses_sinegen2(kit_hift_v2: HiFTGenerator) -> None:
    assert kit_hift_v2.config.sampling_rate == 24000 and kit_hift_v2.config.hop == 480
    assert isinstance(kit_hift_v2.m_source.l_sin_gen, SineGen2)


def test_draws_follow_the_official_sequence(kit_hift_v2: HiFTGenerator) -> None:
    """rand [B, H+1], randn [B, L, H+1], then the unused randn [B, L, 1]: a seeded stream stays in step."""
    frames, harmonics = 3, kit_hift_v2.config.nb_harmonics + 1
    length = frames * kit_hift_v2.config.hop
    generator = torch.Generator().manual_seed(11)
    first = kit_hift_v2.sample_source_draws(2, frames, generator)
    second = kit_hift_v2.sample_source_draws(2, frames, generator)
    reference = torch.Generator().manual_seed(11)
    assert torch.equal(first.initial_phase, torch.rand((2, harmonics), generator=reference))
    assert torch.equal(first.noise, torch.randn((2, length, harmonics), generator=reference))
    torch.randn((2, length, 1), generator=reference)
    assert torch.equal(second.initial_phase, torch.rand((2, harmonics), generator=reference))


def test_initial_phase_of_the_fundamental_is_ignored(
    kit_hift_v2: HiFTGenerator, replayable_cases: list[dict[str, Any]]
) -> None:
    case = replayable_cases[0]
    draws = _recorded_draws(case)
    fundamental_shift = torch.zeros_like(draws.initial_phase)
    fundamental_shift[:, 0] = 0.25
    shifted = Sine2Draws(draws.initial_phase + fundamental_shift, draws.noise)
    with torch.inference_mode():
        assert torch.equal(
            kit_hift_v2.source_from_draws(case["f0"], draws), kit_hift_v2.source_from_draws(case["f0"], shifted)
        )


def _padded_draws(draws: list[Sine2Draws], length: int) -> Sine2Draws:
    noise = [F.pad(d.noise, (0, 0, 0, length - d.noise.shape[1]), value=1.0) for d in draws]
    return Sine2Draws(torch.cat([d.initial_phase for d in draws]), torch.cat(noise))


def test_batched_source_equals_alone_when_f0_padding_is_zero(
    kit_hift_v2: HiFTGenerator, replayable_cases: list[dict[str, Any]]
) -> None:
    """Zero f0 past an item keeps its frame phase constant, so the x480 interpolation sees what it sees alone;
    nonzero f0 there would change exactly the last hop/2 samples (the up-interpolation's edge)."""
    hop = kit_hift_v2.config.hop
    cut = min(7, replayable_cases[-1]["f0"].shape[-1] - 1)  # a shorter copy of the last case
    f0s = [case["f0"][0] for case in replayable_cases] + [replayable_cases[-1]["f0"][0, :cut]]
    draws = [_recorded_draws(case) for case in replayable_cases]
    draws.append(Sine2Draws(draws[-1].initial_phase, draws[-1].noise[:, : cut * hop]))
    frames = max(f0.shape[-1] for f0 in f0s)
    batch_draws = _padded_draws(draws, frames * hop)
    with torch.inference_mode():
        zero_padding = torch.stack([F.pad(f0, (0, frames - len(f0))) for f0 in f0s])
        batched = kit_hift_v2.source_from_draws(zero_padding, batch_draws)
        for i, (f0, item_draws) in enumerate(zip(f0s, draws, strict=True)):
            alone = kit_hift_v2.source_from_draws(f0[None], item_draws)
            assert_close(batched[i : i + 1, :, : alone.shape[-1]], alone, atol=ROUNDING_ATOL, what=f"item {i}")
        voiced_padding = torch.stack([F.pad(f0, (0, frames - len(f0)), value=200.0) for f0 in f0s])
        leaky = kit_hift_v2.source_from_draws(voiced_padding, batch_draws)
    short = len(f0s) - 1
    edge = cut * hop - hop // 2
    assert_close(leaky[short, :, :edge], batched[short, :, :edge], atol=ROUNDING_ATOL, what="before the edge")
    assert (leaky[short, :, edge : cut * hop] - batched[short, :, edge : cut * hop]).abs().max() > 1e-3


def test_batched_inference_equals_alone(kit_hift_v2: HiFTGenerator, hift_cases: list[dict[str, Any]]) -> None:
    by_length = {case["mel"].shape[-1]: case["mel"][0] for case in hift_cases if case["mel"].shape[-1] < 64}
    mels = list(by_length.values())[:3] or [hift_cases[0]["mel"][0, :, :63]]
    mels.append(mels[-1][:, : max(1, mels[-1].shape[-1] // 2)])  # and a shorter copy: unequal lengths in a batch
    seeds = list(range(len(mels)))
    batched = kit_hift_v2.inference(mels, seeds)
    for i, (mel, seed) in enumerate(zip(mels, seeds, strict=True)):
        (alone,) = kit_hift_v2.inference([mel], [seed])
        assert alone.shape == (mel.shape[-1] * kit_hift_v2.config.hop,)
        assert_close(batched[i], alone, atol=BATCH_ATOL, what=f"item {i}")
