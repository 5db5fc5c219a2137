"""Parity of engine.text.frontend with the official CosyVoiceFrontEnd, on every frontend case of the conformance kits:
each with its family's tokenizer (v1: whisper, as its yaml names; v2: the Qwen2 files in model/CosyVoice-BlankEN)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.families.base import ModelConfig
from engine.text.frontend import TextFrontend
from tests.conftest import KIT_YAMLS, kit_group, kit_model_version

WETEXT_INSTALLED = importlib.util.find_spec("wetext") is not None


def require_wetext() -> None:
    """Skip without wetext, except in CI (CI=true), where the `text` extra is installed and a skip would hide
    a broken install."""
    if WETEXT_INSTALLED:
        return
    message = "wetext is not installed (pip install 'cosyvoice-serve[text]')"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{message}; CI must run the frontend parity test")
    pytest.skip(message)


def describe(index: int, case: dict[str, Any]) -> str:
    return f"frontend case #{index} {case['text'][:40]!r}"


@pytest.fixture(scope="module")
def frontend_cases(each_kit: Path) -> list[dict[str, Any]]:
    cases = kit_group(torch.load(each_kit / "cases.pt", weights_only=True), "frontend")
    for index, case in enumerate(cases):
        assert case["allowed_special"] == "all", f"{describe(index, case)} was recorded with another allowed_special"
    return cases


@pytest.fixture(scope="module")
def frontend(each_kit: Path, frontend_cases: list[dict[str, Any]]) -> TextFrontend:
    """The kit's frontend with its family's tokenizer, as the loader builds it for an official model dir (v1: the
    whisper tokenizer its yaml names; v2/v3: the Qwen2 tokenizer files in model/CosyVoice-BlankEN). It needs
    `frontend_cases` first, so that a kit without frontend cases skips before its tokenizer is looked for."""
    path = each_kit / "model" / KIT_YAMLS[kit_model_version(each_kit)]
    config = ModelConfig.from_yaml_file(path)
    return TextFrontend(use_wetext=WETEXT_INSTALLED, tokenizer=config.family.tokenizer(config, path, True))


def test_raw_tokens_match_official_tokenizer(frontend: TextFrontend, frontend_cases: list[dict[str, Any]]) -> None:
    for index, case in enumerate(frontend_cases):
        assert frontend.tokenize(case["text"]) == case["raw_tokens"].tolist(), describe(index, case)


def test_normalisation_and_segments_match_official_wetext_frontend(
    frontend: TextFrontend, frontend_cases: list[dict[str, Any]]
) -> None:
    require_wetext()
    wetext_cases = [(i, case) for i, case in enumerate(frontend_cases) if case["text_frontend"] == "wetext"]
    if not wetext_cases:
        pytest.skip("no frontend case of this kit was recorded with the wetext backend")
    for index, case in wetext_cases:
        what = describe(index, case)
        assert frontend.normalize(case["text"]) == case["normalized_text"], what
        segments = frontend.split(case["text"])
        assert len(segments) == case["num_segments"], what
        assert "\n".join(segments) == case["segments_joined"], what
        segment_tokens = frontend.segment_tokens(case["text"])
        assert [len(tokens) for tokens in segment_tokens] == case["segment_token_lens"].tolist(), what
        assert [token for tokens in segment_tokens for token in tokens] == case["segment_tokens"].tolist(), what
