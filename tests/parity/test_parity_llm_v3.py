"""Numerical parity of the CosyVoice3 LLM (`CosyVoice3LM`) with the official implementation, on every v3 `llm` case:
what only v3 has (the checks every family shares: test_parity_llm.py).

Runs on the kit of `tests/conftest.py`: $COSYVOICE_CONFORMANCE_KIT when it is a CosyVoice3 kit, else
tests/fixtures/cosyvoice3-tiny.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import CheckpointError, InvalidInputError
from engine.llm.cosyvoice3_lm import ENDOFPROMPT_TOKEN, NUM_SPECIAL_SPEECH_TOKENS, CosyVoice3LM, CosyVoice3LMConfig
from engine.llm.generation import GenerationRequest
from tests.conftest import strictly_loaded, v3_kit_cases, v3_kit_dir, v3_yaml
from tests.parity.test_parity_llm import decode_greedily, kit_request

RAW_LOGP_ATOL = 1e-4


@pytest.fixture(scope="module")
def kit() -> Path:
    return v3_kit_dir()


@pytest.fixture(scope="module")
def llm_cases(kit: Path) -> list[dict[str, Any]]:
    cases = v3_kit_cases(kit)["llm"]
    assert cases, "the kit has no llm cases"
    # the v3 LM has no speaker term; the helper's request takes the case's embedding, so give it none
    return [dict(case, embedding=torch.zeros(0)) for case in cases]


@pytest.fixture(scope="module")
def llm(kit: Path) -> CosyVoice3LM:
    config = CosyVoice3LMConfig.from_yaml(v3_yaml(kit)["llm"], kit / "model")
    return strictly_loaded(CosyVoice3LM(config), kit, "llm")


def test_special_ids(llm: CosyVoice3LM, llm_cases: list[dict[str, Any]]) -> None:
    """sos, eos and task id are rows V, V+1, V+2 of the speech table; all 200 ids from V stop decoding."""
    size = llm.cfg.speech_token_size
    assert llm.llm_decoder.out_features == llm.speech_embedding.num_embeddings == size + NUM_SPECIAL_SPEECH_TOKENS
    for case in llm_cases:
        assert (case["sos_token"], case["eos_token"], case["task_id_token"]) == (size, size + 1, size + 2)
        assert case["stop_token_ids"].tolist() == list(range(llm.eos, llm.eos + NUM_SPECIAL_SPEECH_TOKENS))


def test_greedy_decoding_step_by_step(llm: CosyVoice3LM, llm_cases: list[dict[str, Any]]) -> None:
    for case in llm_cases:
        name = case["name"]
        events = decode_greedily(llm, case)
        stopped = case["stop_reason"] == "stop_token"
        assert events[-1].finish_reason == ("eos" if stopped else "max_len"), name
        if stopped:
            assert int(events[-1].logprobs.argmax()) == case["stop_token"], name

        # what our sampler saw: as official, id V is -inf before min_len
        scores = torch.stack([e.logprobs for e in events])
        before_min_len = torch.arange(len(events)) < case["min_len"]
        assert torch.equal(torch.isinf(scores[:, llm.eos]), before_min_len), name
        assert not torch.isinf(scores[:, llm.eos + 1 :]).any(), name  # the other stop ids are not masked
        unmasked = ~torch.isinf(scores)
        raw = case["step_raw_logp"]
        torch.testing.assert_close(scores[unmasked], raw[unmasked], atol=RAW_LOGP_ATOL, rtol=0, msg=name)
        # where the official sampler saw a clear winner, ours agrees on it
        assert (case["step_top1_margin"] > 2 * RAW_LOGP_ATOL).all(), f"{name}: a greedy step is a near-tie"


def test_batched_decoding_equals_alone(llm: CosyVoice3LM, llm_cases: list[dict[str, Any]]) -> None:
    requests = [kit_request(llm, case) for case in llm_cases]
    batched = llm.generate(requests)
    for case, tokens in zip(llm_cases, batched, strict=True):
        assert torch.equal(tokens, case["out_tokens"]), case["name"]


def test_text_without_endofprompt_is_rejected(llm: CosyVoice3LM) -> None:
    text = torch.tensor([[5, 6, ENDOFPROMPT_TOKEN, 7], [5, 6, 7, ENDOFPROMPT_TOKEN]])
    with pytest.raises(InvalidInputError, match="endofprompt"):
        llm.encode_text(text, torch.tensor([4, 3]))  # row 1's marker lies in its padding
    assert llm.encode_text(text, torch.tensor([4, 4])).shape == (2, 4, llm.cfg.llm_input_size)


def test_prompt_speech_tokens_must_be_speech_ids(llm: CosyVoice3LM, llm_cases: list[dict[str, Any]]) -> None:
    request = kit_request(llm, llm_cases[0])
    special = GenerationRequest(
        text_encoded=request.text_encoded,
        text_len=request.text_len,
        prompt_speech_tokens=torch.tensor([llm.eos + 1]),
        options=request.options,
    )
    with pytest.raises(InvalidInputError, match="prompt speech tokens"):
        llm.generate([special])


def test_config_names_the_wrong_llm_class(kit: Path) -> None:
    spec = v3_yaml(kit)["llm"]
    spec.target = "cosyvoice.llm.llm.Qwen2LM"
    with pytest.raises(CheckpointError, match="Qwen2LM"):
        CosyVoice3LMConfig.from_yaml(spec, kit / "model")
