"""Parity of the repetition-aware sampler with the official `ras_sampling`, on every `llm_sampled` case of the v1,
v2 and v3 kits: the official LLM sampled on the global torch RNG seeded with the case's seed; ours with a generator
seeded the same draws the same tokens (the same draws in the same order, and the same token excluded on a
fallback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.llm.sampling import SamplingOptions
from engine.loading.loader import load_module
from tests.conftest import kit_group
from tests.parity.test_parity_llm import kit_request, run_alone


@pytest.fixture(scope="module")
def sampled_cases(each_kit: Path) -> list[dict[str, Any]]:
    return kit_group(torch.load(each_kit / "cases.pt", weights_only=True), "llm_sampled")


def options_of(case: dict[str, Any]) -> SamplingOptions:
    return SamplingOptions(
        top_p=case["top_p"],
        top_k=case["top_k"],
        win_size=case["win_size"],
        tau_r=case["tau_r"],
        min_token_text_ratio=case["min_token_text_ratio"],
        max_token_text_ratio=case["max_token_text_ratio"],
        seed=case["seed"],
    )


def test_seeded_sampling_replays_the_official_tokens(each_kit: Path, sampled_cases: list[dict[str, Any]]) -> None:
    model = load_module(each_kit / "model", "llm")
    for case in sampled_cases:
        events = run_alone(model, kit_request(model, case, options_of(case)))
        tokens = torch.tensor([e.token for e in events if e.token is not None], dtype=torch.long)
        assert torch.equal(tokens, case["out_tokens"]), case["name"]
        assert len(events) == case["num_steps"], case["name"]


def test_the_cases_exercise_the_fallback_draw(sampled_cases: list[dict[str, Any]]) -> None:
    # without a fallback step the case could not tell the official exclusion from a plain redraw
    assert all(int(case["step_fallback"].sum()) > 0 for case in sampled_cases)
