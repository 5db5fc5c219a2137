"""benchmarks/fallback_rates.py: the batch sizes it times, the bound on the batching gain, and a tiny run of the
batched path (the start-up part needs a Ray of its own: it ran for docs/fallback_rates/run1_*.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import fallback_rates
from benchmarks.fallback_rates import batch_rows, batch_sizes, profile_fallback
from serve_app.bench.timing import FailedMeasurements, Timing


def test_batch_sizes_double_up_to_the_profiles_bound() -> None:
    assert batch_sizes(1) == [1] and batch_sizes(4) == [1, 2, 4] and batch_sizes(6) == [1, 2, 4, 6]
    assert profile_fallback().max_batch_size == 4  # configs/gpu_cluster.yaml's decoder_cpu, by default


def test_a_batching_gain_past_its_bound_is_a_failed_measurement() -> None:
    seconds = {1: Timing((10.0, 10.0, 10.0)), 2: Timing((12.0, 12.0, 12.0)), 4: Timing((5.0, 5.0, 5.0))}
    failed = FailedMeasurements()
    rows = batch_rows(seconds, seconds, audio_s=5.0, failed=failed)
    assert rows["1"]["rtf"] == 2.0 and rows["1"]["throughput_vs_b1"] == 1.0
    assert rows["2"]["rtf"] == pytest.approx(1.2) and rows["2"]["throughput_vs_b1"] == pytest.approx(5 / 3)
    # batch 4 in half the time of batch 1: 8x its throughput, more than 4 requests can give
    assert rows["4"]["throughput_vs_b1"] is None and rows["4"]["throughput_vs_b1_spread"] is None
    [entry] = failed.entries
    assert entry["name"] == "batches.4.throughput_vs_b1" and entry["value"] == pytest.approx(8.0)


@pytest.mark.slow
def test_a_tiny_run_times_every_batch_size_side_by_side(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "rates.json"
    argv = ["fallback_rates", "--model", "tiny", "--seconds", "0.2", "--repeats", "2", "--warmup", "0"]
    monkeypatch.setattr(sys, "argv", [*argv, "--skip-startup", "--out", str(out)])
    fallback_rates.main()
    result = json.loads(out.read_text())
    assert result["max_batch_size"] == 4 and set(result["rtf"]) == {"1", "2", "4"} and "startup" not in result
    for size, row in result["batches"].items():
        assert row["seconds_spread"]["n"] == 2 and row["cpu_seconds"] > 0
        assert row["rtf"] == pytest.approx(row["seconds"] / (int(size) * 0.2))
        assert len(result["seconds_samples"][size]) == 2
