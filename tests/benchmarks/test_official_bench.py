"""benchmarks/official_bench.py on the tiny preset: the official code's stages (a subprocess of the venv with its
dependencies) and ours, side by side. Runs only where that checkout and venv exist (docs/parity.md, "Conformance kits");
no timing is asserted, the wiring is: both sides make the same number of tokens, frames and samples."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks import official_bench

OFFICIAL = Path(os.environ.get("COSYVOICE_OFFICIAL", "/tmp/cosyvoice-official"))
OFFICIAL_PYTHON = Path(os.environ.get("COSYVOICE_OFFICIAL_PYTHON", "/tmp/offvenv/bin/python"))


def test_only_v1_presets_are_taken() -> None:
    with pytest.raises(SystemExit, match="preset"):
        official_bench.run("some/model/dir", OFFICIAL, str(OFFICIAL_PYTHON), 0.2, 1, 1, 0)
    with pytest.raises(SystemExit, match="v1 only"):
        official_bench.run("cosyvoice2-tiny", OFFICIAL, str(OFFICIAL_PYTHON), 0.2, 1, 1, 0)


def test_a_missing_checkout_or_venv_stops_before_any_model_loads(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not an official CosyVoice checkout"):
        official_bench.run("tiny", tmp_path, str(OFFICIAL_PYTHON), 0.2, 1, 1, 0)
    (tmp_path / "cosyvoice").mkdir()
    with pytest.raises(SystemExit, match="no such python"):
        official_bench.run("tiny", tmp_path, str(tmp_path / "bin" / "python"), 0.2, 1, 1, 0)


@pytest.mark.skipif(
    not (OFFICIAL / "cosyvoice").is_dir() or not OFFICIAL_PYTHON.is_file(),
    reason=f"no official checkout at {OFFICIAL} or venv python at {OFFICIAL_PYTHON} (COSYVOICE_OFFICIAL[_PYTHON])",
)
def test_a_tiny_run_times_the_official_stages_beside_ours() -> None:
    result = official_bench.run("tiny", OFFICIAL, str(OFFICIAL_PYTHON), 0.5, 1, 1, 0, dtype="float32")
    tokens = result["speech_tokens"]
    assert result["official_sizes"]["llm"] == tokens  # min = max tokens on both sides
    assert result["official_sizes"]["hift"] == round(result["audio_seconds"] * 22050)  # the same mel
    for stage in ("llm", "flow", "hift", "decoder"):
        assert result["rtf"][stage]["official"] > 0 and result["rtf"][stage]["float32"] > 0
        assert result["rtf"][stage]["float32_speedup_over_official"] > 0
    assert result["llm_ms_per_token"]["official"] > 0
    assert result["choice"] == {"llm": "float32", "flow": "float32", "hift": "float32"}
