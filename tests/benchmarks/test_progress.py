"""What every benchmark shows and leaves while it runs (`serve_app.bench.progress`): one readable line per step when its
stderr is a pipe, its JSON written as it goes and marked `"complete": false` until the run ends with every part
measured, and a time budget that skips the parts it leaves no time for. Then a real benchmark cut short by its
budget: `benchmarks.compare` on the tiny model. No timing is asserted."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path

import pytest

from benchmarks import compare
from serve_app.bench.progress import BenchmarkRun


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_run_writes_its_report_as_it_goes_and_marks_it_complete_at_the_end(tmp_path: Path) -> None:
    out, stderr, clock = tmp_path / "run.json", io.StringIO(), FakeClock()
    bench = BenchmarkRun("demo", out, stream=stderr, clock=clock)
    bench.plan(2)

    clock.now = 30.0
    bench.step("first part", seconds={"llm": 1.5})
    partial = json.loads(out.read_text())
    with bench.phase("second part"):
        clock.now = 95.0
        bench.step("second part", seconds={"flow": 0.5})
    report = bench.finish({"rtf": 2.0})

    assert partial == {"complete": False, "seconds": {"llm": 1.5}, "run_s": 30.0}
    assert report == json.loads(out.read_text())
    # the groups filled part by part, the phase timed, the run complete
    assert report["complete"] is True and report["seconds"] == {"llm": 1.5, "flow": 0.5} and report["rtf"] == 2.0
    assert report["phase_s"] == {"second part": 65.0} and report["run_s"] == 95.0
    lines = stderr.getvalue().splitlines()
    assert "\r" not in stderr.getvalue()  # piped: lines, not a redrawn bar
    assert lines[0] == "[demo] 1/2 (50%) first part (0m30s spent, ~0m30s left)"
    assert lines[1].startswith("[demo] 2/2 (100%) second part (1m35s spent")
    assert lines[2] == "[demo] second part took 1m05s"
    assert not list(tmp_path.glob("*.partial"))  # each write renamed over the report


def test_a_spent_budget_skips_the_parts_left_and_the_report_stays_incomplete(tmp_path: Path) -> None:
    out, clock = tmp_path / "run.json", FakeClock()
    bench = BenchmarkRun("demo", out, budget_minutes=1.0, stream=io.StringIO(), clock=clock)

    clock.now = 40.0
    assert bench.seconds_left() == 20.0 and not bench.out_of_time("level 2")
    clock.now = 61.0
    assert bench.seconds_left() == 0.0 and bench.out_of_time("level 3") and bench.out_of_time("level 4")
    report = bench.finish({"level_1": 0.5})

    assert report["complete"] is False and report["level_1"] == 0.5
    assert report["stopped"] == {"reason": "the time budget of 1 minutes was spent", "skipped": ["level 3", "level 4"]}
    assert json.loads(out.read_text()) == report
    assert BenchmarkRun("no budget", budget_minutes=0).seconds_left() is None  # 0: no budget


def test_a_part_that_outlasts_the_budget_is_cancelled_and_named() -> None:
    bench = BenchmarkRun("demo", budget_minutes=0.001, stream=io.StringIO())  # 0.06 s
    cancelled = asyncio.Event()

    async def endless_level() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "measured"

    async def run() -> str | None:
        return await bench.within_budget(endless_level(), "poisson 0.5/s")

    assert asyncio.run(run()) is None and cancelled.is_set()
    assert bench.report["stopped"]["skipped"] == ["poisson 0.5/s"]


@pytest.mark.slow
def test_compare_cut_short_by_its_budget_leaves_the_figures_it_took_marked_incomplete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget spent while the engine part runs (loading the model alone outlasts 0.06 s): the engine's figures are
    written, no server is started, and every figure that needs a server is null."""
    out = tmp_path / "compare.json"
    argv = ["compare", "--model", "tiny", "--clients", "1", "2", "--requests", "1", "--repeats", "1", "--warmup", "0"]
    monkeypatch.setattr(sys, "argv", [*argv, "--budget-minutes", "0.001", "--out", str(out)])

    compare.main()

    report = json.loads(out.read_text())
    assert report["complete"] is False
    assert report["stopped"]["skipped"] == ["ray serve", "baseline"]
    assert report["engine"]["decoder_throughput_b1"] > 0 and report["engine"]["decoder_throughput_b2"] > 0
    assert set(report["phase_s"]) == {"engine"}
    for key in ("batching_efficiency_c2", "throughput_ratio_c2", "overhead_ms_c1", "late_arrival_ttfa_ratio"):
        assert report[key] is None and report[f"{key}_spread"] is None
    assert report["ray_serve"] == [] and report["baseline"] == [] and report["setup"]["model"] == "tiny"
    assert out.with_suffix(".png").is_file()
