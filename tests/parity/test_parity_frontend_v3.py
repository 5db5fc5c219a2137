"""The CosyVoice3 text path recorded in the v3 kit's `frontend` group (official `text_normalize` with wetext and
`_extract_text_token` with `CosyVoice3Tokenizer` over the kit's tiny Qwen2-format tokenizer): what is CosyVoice3's
own. Every case's ids, normalisation and segments are checked for every kit by test_parity_frontend.py, with
the tokenizer the family builds; here, the tokenizer files, the ids of CosyVoice3's tags and the texts the
official front end leaves as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.families import COSYVOICE3
from engine.families.base import ModelConfig
from engine.llm.cosyvoice3_lm import ENDOFPROMPT_TOKEN
from engine.llm.qwen2_lm import QWEN_DIR
from engine.text.frontend import ENDOFPROMPT, TextFrontend
from engine.text.qwen_tokenizer import COSYVOICE2_SPECIAL_TOKENS, QwenTokenizer
from tests.conftest import V3_YAML, v3_kit_cases, v3_kit_dir
from tests.engine.conftest import write_tiny_qwen_tokenizer

# the ids the official CosyVoice3Tokenizer gives over Qwen2's added tokens (the kit README's table)
RELEASED_TAG_IDS = {ENDOFPROMPT: 151646, "[breath]": 151647, "<|endofsystem|>": 151663, "[AA]": 151664, "[ǜ]": 151923}


@pytest.fixture(scope="module")
def kit() -> Path:
    return v3_kit_dir()


@pytest.fixture(scope="module")
def frontend_cases(kit: Path) -> list[dict[str, Any]]:
    cases = v3_kit_cases(kit).get("frontend")
    if not cases:
        pytest.skip("the kit has no frontend group")
    assert all(case["allowed_special"] == "all" for case in cases)
    return cases


@pytest.fixture(scope="module")
def tokenizer(kit: Path) -> QwenTokenizer:
    """The kit dir's tokenizer as the loader builds it for an official CosyVoice3 dir."""
    path = kit / "model" / V3_YAML
    config = ModelConfig.from_yaml_file(path)
    assert config.family is COSYVOICE3
    return COSYVOICE3.tokenizer(config, path, True)


def describe(case: dict[str, Any]) -> str:
    return f"frontend case {case['text'][:40]!r}"


def test_tokenizer_files_are_the_tiny_ones_with_qwen2_ids(kit: Path, tmp_path: Path) -> None:
    written = write_tiny_qwen_tokenizer(tmp_path / QWEN_DIR, qwen2_ids=True)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (kit / "model" / QWEN_DIR / name).read_bytes() == (written / name).read_bytes(), name


def test_endofprompt_has_the_id_the_llm_requires(
    tokenizer: QwenTokenizer, frontend_cases: list[dict[str, Any]]
) -> None:
    assert tokenizer.encode(ENDOFPROMPT) == [ENDOFPROMPT_TOKEN]
    with_tag = [case for case in frontend_cases if ENDOFPROMPT in case["text"]]
    assert with_tag, "the kit has no frontend case with <|endofprompt|>"
    for case in with_tag:
        assert ENDOFPROMPT_TOKEN in case["raw_tokens"].tolist(), describe(case)


def test_cosyvoice3_tags_have_their_official_ids(
    tokenizer: QwenTokenizer, frontend_cases: list[dict[str, Any]]
) -> None:
    """The tags CosyVoice3 adds after CosyVoice2's (phonemes such as `[j]`, `<|endofsystem|>`) are single ids."""
    for tag, token_id in RELEASED_TAG_IDS.items():
        assert tokenizer.encode(tag) == [token_id], tag
    last_cosyvoice2_id = max(tokenizer.encode(token)[0] for token in COSYVOICE2_SPECIAL_TOKENS)
    with_v3_tags = [case for case in frontend_cases if int(case["raw_tokens"].max()) > last_cosyvoice2_id]
    assert with_v3_tags, "no frontend case holds a CosyVoice3-only tag"
    for case in with_v3_tags:
        assert tokenizer.encode(case["text"]) == case["raw_tokens"].tolist(), describe(case)


def test_text_with_markup_is_one_segment_as_written(
    tokenizer: QwenTokenizer, frontend_cases: list[dict[str, Any]]
) -> None:
    """Every text with a system prompt or an instruction (`<|...|>`) is neither normalised nor split, however long
    (no wetext needed: that rule comes first)."""
    frontend = TextFrontend(use_wetext=False, tokenizer=tokenizer)
    skipped = [case for case in frontend_cases if case["normalization_skipped"]]
    assert skipped, "the kit has no frontend case the official front end left as it was"
    for case in skipped:
        assert frontend.split(case["text"]) == [case["text"]] == [case["normalized_text"]], describe(case)
