"""The conformance-kit plumbing of tests/conftest.py and hift_pipeline.py, and the frontend test's CI rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tests.parity.test_parity_frontend as test_parity_frontend
from tests.conftest import _require_kit_layout
from tests.parity.hift_pipeline import require_spread_fields


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


@pytest.mark.parametrize(
    ("case", "missing", "tool"),
    [
        # a v2 case from before the spreads: each compared tensor's spread, and the end-to-end one (draws recorded)
        (
            {"name": "mel12", "mel": 0, "conv_pre_out": 0, "speech": 0, "rand_draw_order": "torch.rand"},
            "spread_conv_pre_out, spread_speech, spread_e2e_speech",
            "make_conformance_kit.py",
        ),
        # spreads of the stages but not end to end
        (
            {"name": "c", "speech": 0, "spread_speech": 1e-6, "finalize": 1},
            "spread_e2e_speech",
            "make_cosyvoice3_kit.py",
        ),
    ],
)
def test_a_kit_without_the_spreads_fails_naming_the_field_and_the_command(
    tmp_path: Path, case: dict, missing: str, tool: str
) -> None:
    with pytest.raises(pytest.fail.Exception) as failure:
        require_spread_fields([case], tmp_path)
    message = str(failure.value)
    assert f"has no {missing} (a kit in an older format)" in message
    assert f"`python tools/{tool} --official <CosyVoice checkout> --out {tmp_path} --respread`" in message


def test_a_source_recorded_without_its_sines_is_an_input_and_needs_no_spread(tmp_path: Path) -> None:
    require_spread_fields(
        [{"name": "e2e", "source": 0, "speech": 0, "spread_speech": 0.0, "rand_draw_order": ""}], tmp_path
    )
