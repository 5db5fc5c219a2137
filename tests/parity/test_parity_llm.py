"""Numerical parity of each family's LLM (v1 `TransformerLM`, CosyVoice2 `Qwen2LM`, CosyVoice3 `CosyVoice3LM`) with
the official implementation, on every `llm` case of each kit (`each_kit`, tests/conftest.py). What only one family
has is checked in test_parity_llm_v2.py and test_parity_llm_v3.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engine.errors import CheckpointError
from engine.families.base import ModelConfig
from engine.llm.generation import GenerationRequest, TokenEvent, TokenGenerator
from engine.llm.sampling import SamplingOptions
from engine.loading.checkpoint import load_strict, read_state_dict
from engine.loading.loader import load_module
from tests.conftest import KIT_MODEL_VERSIONS, KIT_YAMLS, kit_group

TOP5_ATOL = 1e-4
RAW_LOGP_ATOL = {1: 2e-4, 2: 3e-4}  # the kit READMEs' acceptance for step_raw_logp (v3's: test_parity_llm_v3.py)
# v1 prefills with its text encoder's output; v2/v3 concatenate embedding rows: exact up to copying
PREFILL_ATOL = {1: 5e-5, 2: 1e-6, 3: 1e-6}
HIDDEN_ATOL = 5e-5
# a key of the checkpoint to drop or reshape, and one no model of the family has
DAMAGED_KEYS = {
    1: ("self_attn.linear_pos.weight", "llm.encoders.0.self_attn.linear_extra.weight"),
    2: ("self_attn.k_proj.weight", "llm.model.model.layers.0.self_attn.rotary_emb.inv_freq"),
    3: ("self_attn.k_proj.weight", "llm_embedding.weight"),  # the v2 table, absent from v3
}


def case_text(case: dict[str, Any]) -> torch.Tensor:
    """concat(prompt_text, text) of a case: [1, T] long."""
    return torch.cat([case["prompt_text"], case["text"]], dim=1).long()


def kit_request(model: nn.Module, case: dict[str, Any], options: SamplingOptions | None = None) -> GenerationRequest:
    """The case as a request; greedy with the case's length ratios unless `options` is given. A case without an
    `embedding` (v3: no speaker term) gives none."""
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
        embedding=case.get("embedding"),
        prompt_speech_tokens=case["prompt_speech_token"][0],
        options=options,
    )


def run_alone(model: nn.Module, request: GenerationRequest) -> list[TokenEvent]:
    """Every event of one request decoded on its own."""
    generator = TokenGenerator(model)
    generator.add(request)
    events = []
    while generator.active:
        events += generator.step()
    return events


def decode_greedily(llm: nn.Module, case: dict[str, Any]) -> list[TokenEvent]:
    """The case decoded greedily on its own, after checking its length bounds; its tokens must be the official ones."""
    name = case["name"]
    request = kit_request(llm, case)
    assert int(request.text_len * request.options.min_token_text_ratio) == case["min_len"], name
    assert int(request.text_len * request.options.max_token_text_ratio) == case["max_len"], name
    events = run_alone(llm, request)
    assert len(events) == case["num_steps"], name
    tokens = [e.token for e in events if e.token is not None]
    assert torch.equal(torch.tensor(tokens, dtype=torch.long), case["out_tokens"]), name
    return events


@pytest.fixture(scope="module")
def llm(each_kit: Path) -> nn.Module:
    """The kit's LLM, of its family's class, strictly loaded from llm.pt through the loader."""
    return load_module(each_kit / "model", "llm")


@pytest.fixture(scope="module")
def llm_cases(each_kit_cases: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return kit_group(each_kit_cases, "llm")


def test_kit_is_of_its_family(llm: nn.Module, each_kit_cases: dict[str, Any], each_kit_version: int) -> None:
    meta = each_kit_cases["meta"][0]
    assert meta["model_version"].startswith(KIT_MODEL_VERSIONS[each_kit_version]), meta["model_version"]
    function = f"cosyvoice.llm.llm.{type(llm).__name__}.inference"
    assert all(case["function"] == function for case in each_kit_cases.get("llm", []))


def test_text_encoder_out(llm: nn.Module, llm_cases: list[dict[str, Any]]) -> None:
    if "text_encoder_out" not in llm_cases[0]:
        pytest.skip("this kit records no text_encoder_out: its text encoder is an embedding lookup (prefill checks it)")
    for case in llm_cases:
        text = case_text(case)
        with torch.inference_mode():
            out = llm.encode_text(text, torch.tensor([text.shape[1]]))
        reference = case["text_encoder_out"]
        assert out.shape == reference.shape, case["name"]
        torch.testing.assert_close(out, reference, atol=HIDDEN_ATOL, rtol=0, msg=case["name"])


def test_lm_input_prefill(llm: nn.Module, llm_cases: list[dict[str, Any]], each_kit_version: int) -> None:
    for case in llm_cases:
        with torch.inference_mode():
            lm_input = llm.lm_input(kit_request(llm, case))
        reference = case["lm_input_prefill"][0]
        assert lm_input.shape == reference.shape, case["name"]
        atol = PREFILL_ATOL[each_kit_version]
        torch.testing.assert_close(lm_input, reference, atol=atol, rtol=0, msg=case["name"])


def test_greedy_decoding_step_by_step(llm: nn.Module, llm_cases: list[dict[str, Any]], each_kit_version: int) -> None:
    if "step_top5_logp" not in llm_cases[0]:
        pytest.skip("this kit records no top-5 scores per step (v3: test_parity_llm_v3.py checks its greedy steps)")
    for case in llm_cases:
        name = case["name"]
        events = decode_greedily(llm, case)
        assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1), name
        assert events[-1].finish_reason == case["stop_reason"], name
        if case["stop_reason"] == "eos":
            stop_ids = case["stop_token_ids"].tolist() if "stop_token_ids" in case else [llm.eos]  # v1: EOS only
            assert events[-1].token is None and case["stop_token"] in stop_ids, name
            assert int(events[-1].logprobs.argmax()) == case["stop_token"], name

        scores = torch.stack([e.logprobs for e in events])  # what the sampler saw, per step
        masked = torch.isinf(scores[:, llm.eos])
        assert torch.equal(masked, case["step_eos_masked"].bool()), name
        # official: only EOS is masked before min_len; CosyVoice2's two other stop ids stay open
        assert not torch.isinf(scores[:, llm.eos + 1 :]).any(), name
        top5 = scores.topk(5, dim=-1).values
        torch.testing.assert_close(top5, case["step_top5_logp"], atol=TOP5_ATOL, rtol=0, msg=name)
        # the reference top-5 tokens have the reference scores in ours too (robust to near-ties in the order)
        at_reference_ids = scores.gather(1, case["step_top5_ids"])
        torch.testing.assert_close(at_reference_ids, case["step_top5_logp"], atol=TOP5_ATOL, rtol=0, msg=name)
        raw = case["step_raw_logp"]
        assert raw.shape == scores.shape, name
        unmasked = ~torch.isinf(scores)
        assert int(unmasked.sum()) == raw.numel() - int(masked.sum()), name
        atol = RAW_LOGP_ATOL[each_kit_version]
        torch.testing.assert_close(scores[unmasked], raw[unmasked], atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("damage", ["missing", "unexpected", "misshaped"])
def test_checkpoint_mismatch_names_the_key(each_kit: Path, each_kit_version: int, damage: str) -> None:
    path = each_kit / "model" / "llm.pt"
    state = read_state_dict(path)
    damaged, unexpected = DAMAGED_KEYS[each_kit_version]
    key = next(k for k in state if k.endswith(damaged))
    if damage == "missing":
        del state[key]
    elif damage == "unexpected":
        key = unexpected
        state[key] = torch.zeros(1)
    else:
        state[key] = torch.zeros(state[key].shape[0] + 1, state[key].shape[1])
    config = ModelConfig.from_yaml_file(each_kit / "model" / KIT_YAMLS[each_kit_version])
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")) as error:
        load_strict(config.family.modules["llm"](config.llm), state, path)
    assert damage.replace("misshaped", "mis-shaped") in str(error.value)
