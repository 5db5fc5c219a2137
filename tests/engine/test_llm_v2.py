"""Stopping, precision and config handling of the CosyVoice2 LLM (`Qwen2LM`); its batching and request checks are
test_llm.py's, run on every kit."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import CheckpointError, InvalidInputError
from engine.llm.qwen2_lm import QWEN_DIR, Qwen2Config, Qwen2Encoder, Qwen2LM, Qwen2LMConfig
from engine.llm.sampling import SamplingOptions
from engine.loading.yaml_config import load_model_yaml
from tests.conftest import KIT_YAMLS
from tests.parity.test_parity_llm import case_text, kit_request, run_alone

BATCH_ATOL = 1e-4


@pytest.fixture(scope="module")
def llm_cases(v2_kit_cases: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    cases = v2_kit_cases["llm"]
    assert len(cases) >= 2, "batching tests need at least two llm cases"
    return cases


def tiny_qwen2(**overrides: Any) -> Qwen2Config:
    sizes = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4}
    sizes |= {"num_key_value_heads": 2, "vocab_size": 50, "rms_norm_eps": 1e-6, "rope_theta": 1e6}
    return Qwen2Config(**(sizes | {"tie_word_embeddings": True} | overrides))


def test_encode_text_is_the_token_embedding(kit_qwen2_llm: Qwen2LM, llm_cases: list[dict[str, Any]]) -> None:
    texts = [case_text(case)[0] for case in llm_cases]
    assert len({len(t) for t in texts}) > 1, "the kit's texts should have mixed lengths"
    lengths = torch.tensor([len(t) for t in texts])
    batch = torch.nn.utils.rnn.pad_sequence(texts, batch_first=True)
    table = kit_qwen2_llm.llm.model.model.embed_tokens.weight
    with torch.inference_mode():
        batched = kit_qwen2_llm.encode_text(batch, lengths)
        for row, text in enumerate(texts):
            alone = kit_qwen2_llm.encode_text(text[None], lengths[row : row + 1])[0]
            torch.testing.assert_close(batched[row, : len(text)], alone, atol=0, rtol=0)
            torch.testing.assert_close(alone, table[text.long()], atol=0, rtol=0)
    with pytest.raises(InvalidInputError):
        kit_qwen2_llm.encode_text(torch.tensor([[kit_qwen2_llm.cfg.qwen.vocab_size]]), torch.tensor([1]))


def test_lm_head_is_tied_and_unused_weights_load(kit_qwen2_llm: Qwen2LM) -> None:
    qwen = kit_qwen2_llm.llm.model
    assert kit_qwen2_llm.cfg.qwen.tie_word_embeddings
    assert qwen.lm_head.weight.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()
    assert "llm.model.lm_head.weight" in kit_qwen2_llm.state_dict()


def test_padding_and_incremental_decoding() -> None:
    """Right-padded full pass == each sequence alone == prefill + one position at a time; left-padded prefill too."""
    torch.manual_seed(0)
    encoder = Qwen2Encoder(tiny_qwen2()).eval()
    lengths = torch.tensor([9, 4, 1])
    x = torch.randn(3, 9, 16)
    with torch.inference_mode():
        batched = encoder(x, lengths)
        alone = [encoder(x[row : row + 1, :length], lengths[row : row + 1])[0] for row, length in enumerate(lengths)]
        for row, length in enumerate(lengths.tolist()):
            torch.testing.assert_close(batched[row, :length], alone[row], atol=BATCH_ATOL, rtol=0)
        # left-padded: RoPE positions are counted per row, so they do not shift with the padding
        left = torch.stack([torch.cat([torch.zeros(9 - n, 16), x[row, :n]]) for row, n in enumerate(lengths.tolist())])
        valid = torch.arange(9) >= (9 - lengths)[:, None]
        prefilled = encoder.forward_incremental(left, valid, encoder.new_cache(3))
        for row, length in enumerate(lengths.tolist()):
            torch.testing.assert_close(prefilled[row, 9 - length :], alone[row], atol=BATCH_ATOL, rtol=0)
        cache = encoder.new_cache(1)
        steps = [encoder.forward_incremental(x[:1, :3], torch.ones(1, 3, dtype=torch.bool), cache)]
        for t in range(3, 9):
            steps.append(encoder.forward_incremental(x[:1, t : t + 1], torch.ones(1, 1, dtype=torch.bool), cache))
        torch.testing.assert_close(torch.cat(steps, dim=1)[0], alone[0], atol=BATCH_ATOL, rtol=0)


def test_speaker_embedding_is_ignored(kit_qwen2_llm: Qwen2LM, llm_cases: list[dict[str, Any]]) -> None:
    request = kit_request(kit_qwen2_llm, llm_cases[0])
    without = replace(request, embedding=None)
    odd_size = replace(request, embedding=torch.ones(7))
    assert torch.equal(kit_qwen2_llm.lm_input(request), kit_qwen2_llm.lm_input(without))
    tokens = kit_qwen2_llm.generate([request, without, odd_size])
    assert all(torch.equal(tokens[0], other) for other in tokens[1:])


@pytest.mark.parametrize("offset", [1, 2])
def test_the_other_stop_ids_end_a_request_before_min_len_unless_masked_on_request(
    kit_qwen2_llm: Qwen2LM, llm_cases: list[dict[str, Any]], offset: int
) -> None:
    """speech_token_size + 1 / + 2 stop a request like EOS. As in the official code, only EOS is masked before
    min_len, so a model preferring +1/+2 stops at once; `mask_all_stop_ids_before_min_len` masks them too."""
    model = copy.deepcopy(kit_qwen2_llm)
    with torch.no_grad():
        model.llm_decoder.bias[model.eos + offset] += 1e4
    case = next(c for c in llm_cases if c["min_len"] > 0)
    request = kit_request(model, case)
    [official] = run_alone(model, request)
    assert official.token is None and official.finish_reason == "eos"
    assert torch.isinf(official.logprobs[model.eos]) and int(official.logprobs.argmax()) == model.eos + offset

    options = replace(request.options, mask_all_stop_ids_before_min_len=True)
    events = run_alone(model, replace(request, options=options))
    min_len = int(request.text_len * request.options.min_token_text_ratio)
    assert [e.token is not None for e in events] == [True] * min_len + [False]
    assert all(torch.isinf(e.logprobs[model.eos :]).all() for e in events[:min_len])
    assert events[-1].finish_reason == "eos" and int(events[-1].logprobs.argmax()) == model.eos + offset


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_model_runs_and_stays_close(
    kit_qwen2_llm: Qwen2LM, llm_cases: list[dict[str, Any]], dtype: torch.dtype
) -> None:
    low = copy.deepcopy(kit_qwen2_llm).to(dtype)
    assert low.llm.model.model.layers[0].self_attn.q_proj.weight.dtype == dtype
    for case in llm_cases:
        # the same fp32-embedded request into both decoders, a few steps: log-probs agree loosely
        request = replace(
            kit_request(kit_qwen2_llm, case),
            options=SamplingOptions(greedy=True, min_token_text_ratio=0.0, max_token_text_ratio=1.0),
        )
        reference, events = run_alone(kit_qwen2_llm, request), run_alone(low, request)
        assert len(events) >= 1
        first, second = reference[0].logprobs, events[0].logprobs
        assert second.dtype == torch.float32 and torch.isfinite(second).all(), case["name"]
        torch.testing.assert_close(second, first, atol=0.02 * float(first.abs().max()), rtol=0, msg=case["name"])


def test_config_comes_from_the_qwen_config_json(v2_kit: Path, kit_qwen2_llm: Qwen2LM) -> None:
    raw = json.loads((v2_kit / "model" / QWEN_DIR / "config.json").read_text())
    qwen = kit_qwen2_llm.cfg.qwen
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.vocab_size) == (
        raw["hidden_size"],
        raw["num_hidden_layers"],
        raw["vocab_size"],
    )
    assert (qwen.num_attention_heads, qwen.num_key_value_heads) == (
        raw["num_attention_heads"],
        raw["num_key_value_heads"],
    )
    assert qwen.rope_theta == raw["rope_theta"] and qwen.rms_norm_eps == raw["rms_norm_eps"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("hidden_act", "gelu"),
        ("use_sliding_window", True),
        ("rope_scaling", {"type": "linear", "factor": 2.0}),
        ("hidden_size", 30),  # disagrees with llm_input_size, and not divisible by the heads
        ("num_key_value_heads", 3),
        ("model_type", "llama"),
    ],
)
def test_unsupported_qwen_configs_are_rejected(v2_kit: Path, tmp_path: Path, key: str, value: Any) -> None:
    spec = load_model_yaml(v2_kit / "model" / KIT_YAMLS[2])["llm"]
    (tmp_path / QWEN_DIR).mkdir()
    raw = json.loads((v2_kit / "model" / QWEN_DIR / "config.json").read_text())
    (tmp_path / QWEN_DIR / "config.json").write_text(json.dumps(raw | {key: value}))
    with pytest.raises(CheckpointError):
        Qwen2LMConfig.from_yaml(spec, tmp_path)


def test_missing_qwen_dir_and_wrong_class_are_rejected(v2_kit: Path, tmp_path: Path) -> None:
    spec = load_model_yaml(v2_kit / "model" / KIT_YAMLS[2])["llm"]
    with pytest.raises(CheckpointError, match=r"config\.json"):
        Qwen2LMConfig.from_yaml(spec, tmp_path)
    shutil.copytree(v2_kit / "model" / QWEN_DIR, tmp_path / QWEN_DIR)
    assert Qwen2LMConfig.from_yaml(spec, tmp_path) == Qwen2LMConfig.from_yaml(spec, v2_kit / "model")
    spec.target = "cosyvoice.llm.llm.TransformerLM"
    with pytest.raises(CheckpointError, match="Qwen2LM"):
        Qwen2LMConfig.from_yaml(spec, tmp_path)
