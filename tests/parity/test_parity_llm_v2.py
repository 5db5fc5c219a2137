"""Numerical parity of what only the CosyVoice2 LLM (`Qwen2LM`) has: its stop ids, on every v2 `llm` case (the
checks every family shares: test_parity_llm.py).

Runs on the v2 kit of `v2_kit` (tests/conftest.py): $COSYVOICE_CONFORMANCE_KIT when it is a v2 kit, else the copy
in tests/fixtures/cosyvoice2-tiny.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.llm.qwen2_lm import Qwen2LM
from tests.conftest import kit_group


@pytest.fixture(scope="module")
def llm_cases(v2_kit_cases: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return kit_group(v2_kit_cases, "llm")


def test_stop_tokens(kit_qwen2_llm: Qwen2LM, llm_cases: list[dict[str, Any]]) -> None:
    """EOS is speech_token_size and every decoder class from it up stops decoding."""
    classes = kit_qwen2_llm.llm_decoder.out_features
    for case in llm_cases:
        assert case["eos_token"] == kit_qwen2_llm.eos, case["name"]
        assert case["stop_token_ids"].tolist() == list(range(kit_qwen2_llm.eos, classes)), case["name"]
