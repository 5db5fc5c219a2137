"""The conformance-kit plumbing of tests/conftest.py and the CI rule of the frontend parity test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tests.parity.test_parity_frontend as test_parity_frontend
from tests.conftest import _require_kit_layout


def make_kit(root: Path, yaml_name: str | None, model_version: str) -> Path:
    (root / "model").mkdir(parents=True)
    if yaml_name:
        (root / "model" / yaml_name).write_text("sample_rate: 1\n", encoding="utf-8")
    torch.save({"meta": [{"model_version": model_version}], "hift": [{"name": "any"}]}, root / "cases.pt")
    return root


def test_a_kit_of_unknown_version_fails_instead_of_skipping(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match="unknown version"):
        _require_kit_layout(make_kit(tmp_path / "none", None, "CosyVoice v1"))
    with pytest.raises(pytest.fail.Exception, match="meta model_version"):
        _require_kit_layout(make_kit(tmp_path / "mismatch", "cosyvoice.yaml", "CosyVoice3 (Fun-CosyVoice3)"))
    assert _require_kit_layout(make_kit(tmp_path / "v2", "cosyvoice2.yaml", "CosyVoice2 (tiny)")) == 2
    empty = make_kit(tmp_path / "empty", "cosyvoice2.yaml", "CosyVoice2 (tiny)")
    torch.save({"meta": [{"model_version": "CosyVoice2 (tiny)"}], "llm": []}, empty / "cases.pt")
    with pytest.raises(pytest.fail.Exception, match="no cases"):
        _require_kit_layout(empty)


@pytest.mark.parametrize(("ci", "outcome"), [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_missing_wetext_fails_in_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch, ci: str, outcome) -> None:
    monkeypatch.setattr(test_parity_frontend, "WETEXT_INSTALLED", False)
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="wetext"):
        test_parity_frontend.require_wetext()
