"""benchmarks/cpu_bench.py on the tiny preset, quickly: every stage's variants timed side by side, the quality
figures against float32, and the choice (`auto`, or a dtype forced with --dtype). No timing is asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import cpu_bench
from benchmarks.cpu_bench import STAGE_VARIANTS, compare


def test_compare_gives_cosine_max_error_and_for_a_waveform_the_spectrum() -> None:
    import numpy as np

    wave = np.sin(np.linspace(0, 400, 4096)).astype(np.float32)
    same = compare(wave, wave, waveform=True)
    assert same["cosine"] == pytest.approx(1.0) and same["max_abs_error"] == 0.0
    assert same["spectral_cosine"] == pytest.approx(1.0) and same["snr_db"] == float("inf")
    assert compare(wave, -wave)["cosine"] == pytest.approx(-1.0)


@pytest.mark.slow
def test_a_tiny_run_reports_every_stage_variant_and_the_choice(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "cpu.json"
    argv = ["cpu_bench", "--model", "tiny", "--seconds", "0.2", "--repeats", "1", "--warmup", "0", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    cpu_bench.main()
    result = json.loads(out.read_text())
    assert result["choice"] == {"llm": "float32", "flow": "float32", "hift": "float32"}  # tiny: float32
    assert result["cpu"]["torch_capability"] and "reason" not in result["choice"]
    for stage, variants in STAGE_VARIANTS.items():
        for variant in variants:
            assert result["rtf"][stage][variant] > 0 and result["rtf"][stage][f"{variant}_spread"]["n"] == 1
    assert result["rtf"]["decoder"]["choice"] == pytest.approx(result["rtf"]["decoder"]["float32"])
    assert set(result["quality"]["llm"]) == {"int8", "int4", "bfloat16"}
    assert 0.99 < result["quality"]["flow"]["bfloat16"]["cosine"] <= 1.0 + 1e-9
    assert "spectral_cosine" in result["quality"]["hift"]["bfloat16"]


def test_a_forced_dtype_is_the_choice(tmp_path: Path) -> None:
    result = cpu_bench.run("tiny", 0.2, threads=1, repeats=1, warmup=0, dtype="bfloat16", quality_only=True)
    assert result["choice"] == {"llm": "bfloat16", "flow": "bfloat16", "hift": "bfloat16"}
    assert result["quality"]["chain"]["cosine"] < 1.0  # the bfloat16 flow and vocoder
    int4 = cpu_bench.run("tiny", 0.2, threads=1, repeats=1, warmup=0, dtype="auto-int4", quality_only=True)
    assert int4["choice"] == {"llm": "int4", "flow": "float32", "hift": "float32"}  # tiny: auto's float32 beside it
    assert "INT4" in int4["choice_reason"]
