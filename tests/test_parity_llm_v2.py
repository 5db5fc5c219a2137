"""Numerical parity of the CosyVoice2 LLM (`Qwen2LM`) with the official implementation, on every v2 `llm` case.

Runs on the v2 kit of `v2_kit` (tests/conftest.py): $COSYVOICE_CONFORMANCE_KIT when it is a v2 kit, else the copy
in tests/fixtures/cosyvoice2-tiny.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import KIT_YAMLS, kit_group
from test_parity_llm import kit_request, run_alone

from engine.checkpoint import load_strict, read_state_dict
from engine.errors import CheckpointError
from engine.qwen2_llm import Qwen2LM, Qwen2LMConfig
from engine.yaml_config import load_model_yaml

TOP5_ATOL = 1e-4
RAW_LOGP_ATOL = 3e-4  # the kit README's acceptance for step_raw_logp
EMBEDDING_ATOL = 1e-6  # lm_input_prefill is a concatenation of embedding rows: exact up to copying


@pytest.fixture(scope="module")
def llm_cases(v2_kit_cases: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return kit_group(v2_kit_cases, "llm")


def test_kit_is_cosyvoice2(v2_kit_cases: dict[str, list[dict[str, Any]]]) -> None:
    meta = v2_kit_cases["meta"][0]
    assert meta["model_version"].startswith("CosyVoice2"), meta["model_version"]
    assert all(case["function"] == "cosyvoice.llm.llm.Qwen2LM.inference" for case in v2_kit_cases.get("llm", []))


def test_lm_input_prefill(kit_qwen2_llm: Qwen2LM, llm_cases: list[dict[str, Any]]) -> None:
    for case in llm_cases:
        with torch.inference_mode():
            lm_input = kit_qwen2_llm.lm_input(kit_request(kit_qwen2_llm, case))
        reference = case["lm_input_prefill"][0]
        assert lm_input.shape == reference.shape, case["name"]
        torch.testing.assert_close(lm_input, reference, atol=EMBEDDING_ATOL, rtol=0, msg=case["name"])


def test_stop_tokens(kit_qwen2_llm: Qwen2LM, llm_cases: list[dict[str, Any]]) -> None:
    """EOS is speech_token_size and every decoder class from it up stops decoding."""
    classes = kit_qwen2_llm.llm_decoder.out_features
    for case in llm_cases:
        assert case["eos_token"] == kit_qwen2_llm.eos, case["name"]
        assert case["stop_token_ids"].tolist() == list(range(kit_qwen2_llm.eos, classes)), case["name"]


def test_greedy_decoding_step_by_step(kit_qwen2_llm: Qwen2LM, llm_cases: list[dict[str, Any]]) -> None:
    model = kit_qwen2_llm
    for case in llm_cases:
        name = case["name"]
        request = kit_request(model, case)
        assert int(request.text_len * request.options.min_token_text_ratio) == case["min_len"], name
        assert int(request.text_len * request.options.max_token_text_ratio) == case["max_len"], name
        events = run_alone(model, request)
        assert len(events) == case["num_steps"], name
        tokens = [e.token for e in events if e.token is not None]
        assert torch.equal(torch.tensor(tokens, dtype=torch.long), case["out_tokens"]), name
        assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1), name
        assert events[-1].finish_reason == case["stop_reason"], name
        if case["stop_reason"] == "eos":
            assert events[-1].token is None and case["stop_token"] in case["stop_token_ids"].tolist(), name
            assert int(events[-1].logprobs.argmax()) == case["stop_token"], name

        scores = torch.stack([e.logprobs for e in events])  # what the sampler saw, per step
        masked = torch.isinf(scores[:, model.eos])
        assert torch.equal(masked, case["step_eos_masked"].bool()), name
        # official: only EOS is masked before min_len; the two other stop ids stay open
        assert not torch.isinf(scores[:, model.eos + 1 :]).any(), name
        top5 = scores.topk(5, dim=-1).values
        torch.testing.assert_close(top5, case["step_top5_logp"], atol=TOP5_ATOL, rtol=0, msg=name)
        # the reference top-5 tokens have the reference scores in ours too (robust to near-ties in the order)
        at_reference_ids = scores.gather(1, case["step_top5_ids"])
        torch.testing.assert_close(at_reference_ids, case["step_top5_logp"], atol=TOP5_ATOL, rtol=0, msg=name)
        raw = case["step_raw_logp"]
        assert raw.shape == scores.shape, name
        unmasked = ~torch.isinf(scores)
        assert int(unmasked.sum()) == raw.numel() - int(masked.sum()), name
        torch.testing.assert_close(scores[unmasked], raw[unmasked], atol=RAW_LOGP_ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("damage", ["missing", "unexpected", "misshaped"])
def test_checkpoint_mismatch_names_the_key(v2_kit: Path, damage: str) -> None:
    path = v2_kit / "model" / "llm.pt"
    state = read_state_dict(path)
    key = next(k for k in state if k.endswith("self_attn.k_proj.weight"))
    if damage == "missing":
        del state[key]
    elif damage == "unexpected":
        key = "llm.model.model.layers.0.self_attn.rotary_emb.inv_freq"
        state[key] = torch.zeros(1)
    else:
        state[key] = torch.zeros(state[key].shape[0] + 1, state[key].shape[1])
    config = Qwen2LMConfig.from_yaml(load_model_yaml(v2_kit / "model" / KIT_YAMLS[2])["llm"], v2_kit / "model")
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")) as error:
        load_strict(Qwen2LM(config), state, path)
    assert damage.replace("misshaped", "mis-shaped") in str(error.value)
