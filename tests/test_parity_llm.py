"""Numerical parity of the v1 LLM (`TransformerLM`) with the official implementation, on every `llm` kit case."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import kit_group

from engine.checkpoint import load_strict, read_state_dict
from engine.errors import CheckpointError
from engine.llm import GenerationRequest, TokenEvent, TokenGenerator, TransformerLM
from engine.loader import ModelConfig
from engine.sampling import SamplingOptions

HIDDEN_ATOL = 5e-5
TOP5_ATOL = 1e-4
RAW_LOGP_ATOL = 2e-4


def case_text(case: dict[str, Any]) -> torch.Tensor:
    """concat(prompt_text, text) of a case: [1, T] long."""
    return torch.cat([case["prompt_text"], case["text"]], dim=1).long()


def kit_request(
    model: TransformerLM, case: dict[str, Any], options: SamplingOptions | None = None
) -> GenerationRequest:
    """The case as a request; greedy with the case's length ratios unless `options` is given."""
    text = case_text(case)
    with torch.inference_mode():
        encoded = model.encode_text(text, torch.tensor([text.shape[1]]))[0]
    options = options or SamplingOptions(
        greedy=True,
        min_token_text_ratio=case["min_token_text_ratio"],
        max_token_text_ratio=case["max_token_text_ratio"],
    )
    return GenerationRequest(
        text_encoded=encoded,
        text_len=int(case["text_len"][0]),
        embedding=case["embedding"],
        prompt_speech_tokens=case["prompt_speech_token"][0],
        options=options,
    )


def run_alone(model: TransformerLM, request: GenerationRequest) -> list[TokenEvent]:
    """Every event of one request decoded on its own."""
    generator = TokenGenerator(model)
    generator.add(request)
    events = []
    while generator.active:
        events += generator.step()
    return events


@pytest.fixture(scope="module")
def llm_cases(kit_cases: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return kit_group(kit_cases, "llm")


def test_text_encoder_out(kit_llm: TransformerLM, llm_cases: list[dict[str, Any]]) -> None:
    for case in llm_cases:
        text = case_text(case)
        with torch.inference_mode():
            out = kit_llm.encode_text(text, torch.tensor([text.shape[1]]))
        reference = case["text_encoder_out"]
        assert out.shape == reference.shape, case["name"]
        torch.testing.assert_close(out, reference, atol=HIDDEN_ATOL, rtol=0, msg=case["name"])


def test_lm_input_prefill(kit_llm: TransformerLM, llm_cases: list[dict[str, Any]]) -> None:
    for case in llm_cases:
        with torch.inference_mode():
            lm_input = kit_llm.lm_input(kit_request(kit_llm, case))
        reference = case["lm_input_prefill"][0]
        assert lm_input.shape == reference.shape, case["name"]
        torch.testing.assert_close(lm_input, reference, atol=HIDDEN_ATOL, rtol=0, msg=case["name"])


def test_greedy_decoding_step_by_step(kit_llm: TransformerLM, llm_cases: list[dict[str, Any]]) -> None:
    for case in llm_cases:
        name = case["name"]
        request = kit_request(kit_llm, case)
        assert int(request.text_len * request.options.min_token_text_ratio) == case["min_len"], name
        assert int(request.text_len * request.options.max_token_text_ratio) == case["max_len"], name
        events = run_alone(kit_llm, request)
        assert len(events) == case["num_steps"], name
        tokens = [e.token for e in events if e.token is not None]
        assert torch.equal(torch.tensor(tokens, dtype=torch.long), case["out_tokens"]), name
        assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1), name
        assert events[-1].finish_reason == case["stop_reason"], name
        if case["stop_reason"] == "eos":
            assert events[-1].token is None and case["stop_token"] == kit_llm.eos, name

        scores = torch.stack([e.logprobs for e in events])  # what the sampler saw, per step
        masked = torch.isinf(scores[:, kit_llm.eos])
        assert torch.equal(masked, case["step_eos_masked"].bool()), name
        top5 = scores.topk(5, dim=-1).values
        torch.testing.assert_close(top5, case["step_top5_logp"], atol=TOP5_ATOL, rtol=0, msg=name)
        # the reference top-5 tokens have the reference scores in ours too (robust to near-ties in the order)
        at_reference_ids = scores.gather(1, case["step_top5_ids"])
        torch.testing.assert_close(at_reference_ids, case["step_top5_logp"], atol=TOP5_ATOL, rtol=0, msg=name)
        raw = case["step_raw_logp"]
        unmasked = ~torch.isinf(scores)
        assert torch.equal(unmasked.sum(), torch.tensor(raw.numel() - int(masked.sum()))), name
        torch.testing.assert_close(scores[unmasked], raw[unmasked], atol=RAW_LOGP_ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("damage", ["missing", "unexpected", "misshaped"])
def test_checkpoint_mismatch_names_the_key(conformance_kit: Path, damage: str) -> None:
    path = conformance_kit / "model" / "llm.pt"
    state = read_state_dict(path)
    key = next(k for k in state if k.endswith("self_attn.linear_pos.weight"))
    if damage == "missing":
        del state[key]
    elif damage == "unexpected":
        key = "llm.encoders.0.self_attn.linear_extra.weight"
        state[key] = torch.zeros(1)
    else:
        state[key] = torch.zeros(state[key].shape[0] + 1, state[key].shape[1])
    model = TransformerLM(ModelConfig.from_yaml_file(conformance_kit / "model" / "cosyvoice.yaml").llm)
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")) as error:
        load_strict(model, state, path)
    assert damage.replace("misshaped", "mis-shaped") in str(error.value)
