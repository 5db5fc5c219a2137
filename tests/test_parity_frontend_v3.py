"""The CosyVoice3 text path recorded in the v3 kit's `frontend` group (official `text_normalize` with wetext and
`_extract_text_token` with `CosyVoice3Tokenizer` over the kit's tiny Qwen2-format tokenizer), checked against the
engine's text front end with the kit's tokenizer files.

The engine's Qwen tokenizer adds CosyVoice2's special tokens; CosyVoice3 adds more after them (`<|endofsystem|>`
and the phoneme tags such as `[j]`), which the engine does not have yet: cases holding those tokens are expected
to fail the token check (strict xfail) until it does.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from kit_v3 import v3_kit_cases, v3_kit_dir
from tokenizer_files import write_tiny_qwen_tokenizer

from engine.frontend import TextFrontend
from engine.llm_v3 import ENDOFPROMPT_TOKEN
from engine.qwen2_llm import QWEN_DIR
from engine.qwen_tokenizer import COSYVOICE2_SPECIAL_TOKENS, QwenTokenizer

WETEXT_INSTALLED = importlib.util.find_spec("wetext") is not None
ENDOFPROMPT = "<|endofprompt|>"


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
    return QwenTokenizer.from_dir(kit / "model" / QWEN_DIR)


@pytest.fixture(scope="module")
def frontend(tokenizer: QwenTokenizer) -> TextFrontend:
    return TextFrontend(use_wetext=WETEXT_INSTALLED, tokenizer=tokenizer)


def needs_cosyvoice3_tokens(case: dict[str, Any], tokenizer: QwenTokenizer) -> bool:
    """Whether the official ids hold a special token CosyVoice3 adds after CosyVoice2's."""
    last_cosyvoice2_id = max(tokenizer.encode(token)[0] for token in COSYVOICE2_SPECIAL_TOKENS)
    return int(case["raw_tokens"].max()) > last_cosyvoice2_id


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


def test_normalisation_and_segments(frontend: TextFrontend, frontend_cases: list[dict[str, Any]]) -> None:
    """Text with `<|...|>` markup is one segment as written; other text is normalised (wetext) and split."""
    if not WETEXT_INSTALLED:
        message = "wetext is not installed (pip install 'cosyvoice-serve[text]')"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{message}; CI must run the frontend parity test")
        pytest.skip(message)
    assert {case["text_frontend"] for case in frontend_cases} == {"wetext"}
    for case in frontend_cases:
        assert frontend.normalize(case["text"]) == case["normalized_text"], describe(case)
        segments = frontend.split(case["text"])
        assert len(segments) == case["num_segments"], describe(case)
        assert "\n".join(segments) == case["segments_joined"], describe(case)
        if case["normalization_skipped"]:
            assert segments == [case["text"]] == [case["normalized_text"]], describe(case)


def check_tokens(frontend: TextFrontend, case: dict[str, Any]) -> None:
    assert frontend.tokenize(case["text"]) == case["raw_tokens"].tolist(), describe(case)
    if WETEXT_INSTALLED:
        segments = frontend.segment_tokens(case["text"])
        assert [len(tokens) for tokens in segments] == case["segment_token_lens"].tolist(), describe(case)
        assert torch.equal(torch.tensor([t for tokens in segments for t in tokens]), case["segment_tokens"])


def test_tokens_of_cosyvoice2_vocabulary_cases(
    frontend: TextFrontend, tokenizer: QwenTokenizer, frontend_cases: list[dict[str, Any]]
) -> None:
    cases = [case for case in frontend_cases if not needs_cosyvoice3_tokens(case, tokenizer)]
    assert cases, "every frontend case needs CosyVoice3's special tokens"
    for case in cases:
        check_tokens(frontend, case)


@pytest.mark.xfail(strict=True, reason="the engine's Qwen tokenizer lacks CosyVoice3's added special tokens")
def test_tokens_of_cases_with_cosyvoice3_tokens(
    frontend: TextFrontend, tokenizer: QwenTokenizer, frontend_cases: list[dict[str, Any]]
) -> None:
    cases = [case for case in frontend_cases if needs_cosyvoice3_tokens(case, tokenizer)]
    if not cases:
        pytest.skip("no frontend case holds a CosyVoice3-only special token")
    for case in cases:
        check_tokens(frontend, case)
