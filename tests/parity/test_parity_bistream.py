"""Numerical parity of bi-streaming (`engine.llm.bistream.BistreamDecoder`) with the official
`Qwen2LM.inference_bistream` / `CosyVoice3LM.inference_bistream`, on the `llm_bistream` cases of the v2 and v3 kits
(the text pushed in the recorded pieces; greedy tokens, or, for a case with a `seed`, the official `ras_sampling` on
the global torch RNG seeded with it, which a generator seeded the same replays)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from engine.errors import InvalidInputError
from engine.llm.bistream import BistreamDecoder
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import load_module
from tests.conftest import kit_group, version_kit

# The kits' acceptance for `step_raw_logp` (v2 README). Its largest deviations are on tail log-probabilities
# (|logp| >= 10, never sampled): 3.0e-5 against the AMD-recorded v3 kit on an Intel Xeon with AMX, 4.2e-5 there with
# MKL's AVX2 kernels (docs/parity.md).
LOGP_ATOL = 3e-4


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def kit(request: pytest.FixtureRequest) -> Path:
    return version_kit(request.param)


@pytest.fixture(scope="module")
def llm(kit: Path) -> nn.Module:
    return load_module(kit / "model", "llm").eval()


@pytest.fixture(scope="module")
def cases(kit: Path) -> list[dict[str, Any]]:
    return kit_group(torch.load(kit / "cases.pt", weights_only=True), "llm_bistream")


def options_of(case: dict[str, Any]) -> SamplingOptions:
    if "seed" not in case:
        return SamplingOptions(greedy=True)
    keys = ("top_p", "top_k", "win_size", "tau_r", "seed")
    return SamplingOptions(**{key: case[key] for key in keys})


def run_case(llm: nn.Module, case: dict[str, Any]) -> tuple[list[list[int]], list[int], Tensor]:
    """The case's pieces pushed in turn, then the end -> (the tokens each push returned, the tokens after the end,
    the log-softmax of every LM step)."""
    steps: list[Tensor] = []
    hook = llm.llm_decoder.register_forward_hook(lambda _m, _a, out: steps.append(out[0].float().log_softmax(-1)))
    try:
        decoder = BistreamDecoder(llm, case["prompt_text"][0], case["prompt_speech_token"][0], options_of(case))
        pushed = [decoder.push_text(case[f"piece_{k}"][0]) for k in range(case["num_pieces"])]
        ending = list(decoder.finish())
    finally:
        hook.remove()
    return pushed, ending, torch.stack(steps)


def test_bistream_matches_official(llm: nn.Module, cases: list[dict[str, Any]]) -> None:
    assert llm.mix_ratio == tuple(cases[0]["mix_ratio"].tolist())
    for case in cases:
        name = case["name"]
        assert (llm.fill_token, llm.end_token) == (case["fill_token"], case["end_token"]), name
        pushed, ending, steps = run_case(llm, case)
        tokens = [token for part in pushed for token in part] + ending
        assert torch.equal(torch.tensor(tokens, dtype=torch.long), case["out_tokens"]), name
        # the tokens came out as the text arrived, as official: yielded_before_piece[k] before piece k was taken
        counts = torch.tensor([0] + [len(part) for part in pushed]).cumsum(0)
        assert torch.equal(counts, case["yielded_before_piece"]), name
        assert len(steps) == case["num_steps"], name
        torch.testing.assert_close(steps, case["step_raw_logp"], atol=LOGP_ATOL, rtol=0, msg=name)
        if "step_top1_margin" in case:
            assert (case["step_top1_margin"] > 2 * LOGP_ATOL).all(), f"{name}: a greedy step is a near-tie"
    assert any("seed" in case for case in cases), "the kit has no sampled bi-streaming case"


def test_length_limit_after_the_end_of_text(llm: nn.Module, cases: list[dict[str, Any]]) -> None:
    """Not official (its loop has no limit): after the end of text, decoding stops at max_token_text_ratio times the
    text tokens pushed; the tokens up to there are the official ones."""
    case = cases[0]
    text_tokens = sum(case[f"piece_{k}"].shape[1] for k in range(case["num_pieces"]))
    limit = len(case["out_tokens"]) - 2
    assert limit > int(case["yielded_before_piece"][-1]), "the limit must fall after the end of text"
    options = SamplingOptions(greedy=True, max_token_text_ratio=(limit + 0.5) / text_tokens)
    decoder = BistreamDecoder(llm, case["prompt_text"][0], case["prompt_speech_token"][0], options)
    tokens = [token for k in range(case["num_pieces"]) for token in decoder.push_text(case[f"piece_{k}"][0])]
    tokens += decoder.finish()
    assert tokens == case["out_tokens"][:limit].tolist()
    with pytest.raises(InvalidInputError, match="after the end"):
        decoder.push_text(torch.tensor([1]))


def test_bad_prompts_are_rejected(llm: nn.Module, cases: list[dict[str, Any]]) -> None:
    case = cases[-1]
    with pytest.raises(InvalidInputError, match="prompt speech tokens"):
        BistreamDecoder(llm, case["prompt_text"][0], torch.tensor([llm.eos]))
    if llm.end_token != llm.eos:  # v3: the official loop asserts <|endofprompt|> in the prompt text
        with pytest.raises(InvalidInputError, match="endofprompt"):
            BistreamDecoder(llm, torch.tensor([5, 6, 7]), case["prompt_speech_token"][0])
