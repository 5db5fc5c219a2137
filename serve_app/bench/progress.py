"""What a benchmark run shows and leaves while it runs, the same in every benchmark (`BenchmarkRun`):

- progress on stderr: a bar (tqdm) on a terminal; piped or redirected, one line per step with the time spent and
  an estimate of the time left, so that a log stays readable (no carriage returns);
- its JSON report, rewritten whole each time figures come in and marked `"complete": false` until the run has
  ended with every part measured (then `true`), so that a run cut short (killed, or stopped by its time budget)
  still leaves the figures taken so far; `run_s` holds the run's wall seconds so far and `phase_s` the seconds
  of each phase that ended;
- a time budget where a benchmark takes one (`--budget-minutes`): before each part the benchmark asks whether
  time is left, skips the parts it has no time for (the report's `stopped` names them), and bounds any wait that
  could outlast the budget by the time left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

T = TypeVar("T")


def _minutes_and_seconds(seconds: float) -> str:
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s"


class Progress:
    """Steps of a run on `stream`: a tqdm bar on a terminal, else one line per step."""

    def __init__(self, name: str, stream: IO[str], clock: Callable[[], float]) -> None:
        self.name, self.stream, self.clock = name, stream, clock
        self.started = clock()
        self.total: int | None = None
        self.done = 0
        self.bar: Any = None

    def plan(self, total: int) -> None:
        self.total = total
        if self.stream.isatty():
            # tqdm comes with huggingface_hub, a dependency; only a terminal gets its bar
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.name, file=self.stream, unit="step", dynamic_ncols=True)

    def advance(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
            return
        spent = self.clock() - self.started
        if self.total:
            left = spent / self.done * max(self.total - self.done, 0)
            where = f"{self.done}/{self.total} ({100 * self.done // self.total}%)"
            times = f"{_minutes_and_seconds(spent)} spent, ~{_minutes_and_seconds(left)} left"
        else:
            where, times = f"step {self.done}", f"{_minutes_and_seconds(spent)} spent"
        print(f"[{self.name}] {where} {label} ({times})", file=self.stream, flush=True)

    def say(self, text: str) -> None:
        """A line that is not a step (a phase ended, the budget ran out), kept clear of the bar."""
        line = f"[{self.name}] {text}"
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class BenchmarkRun:
    """One benchmark run: its progress, its JSON report written as it goes (to `out`; nowhere when None) and its time
    budget (`budget_minutes`; None or 0: none). See the module docstring."""

    def __init__(
        self,
        name: str,
        out: Path | None = None,
        budget_minutes: float | None = None,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out, self.clock = out, clock
        self.budget_s = 60 * budget_minutes if budget_minutes else None
        self.started = clock()
        self.progress = Progress(name, sys.stderr if stream is None else stream, clock)
        self.report: dict[str, Any] = {"complete": False}
        self.skipped: list[str] = []

    def plan(self, steps: int) -> None:
        """The number of steps the run will take (its progress bar's length)."""
        self.progress.plan(steps)

    def record(self, **figures: Any) -> None:
        """Add `figures` to the report and write it; a dict goes into the dict already under its key, so that a part
        can add its own entry to a group (`seconds={"llm": ...}` beside the stages taken before)."""
        for key, value in figures.items():
            held = self.report.get(key)
            self.report[key] = held | value if isinstance(held, dict) and isinstance(value, dict) else value
        self._write()

    def step(self, label: str, **figures: Any) -> None:
        """One step done: its `figures` into the report (written), and the progress advanced."""
        self.record(**figures)
        self.progress.advance(label)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed part into the report's `phase_s[name]` (written when it ends)."""
        started = self.clock()
        yield
        seconds = self.clock() - started
        self.record(phase_s={name: round(seconds, 1)})
        self.progress.say(f"{name} took {_minutes_and_seconds(seconds)}")

    def seconds_left(self) -> float | None:
        """Seconds left of the budget (at least 0); None without one."""
        if self.budget_s is None:
            return None
        return max(0.0, self.budget_s - (self.clock() - self.started))

    def out_of_time(self, part: str) -> bool:
        """Whether the budget is spent, so that `part` is to be skipped (then named in the report's `stopped`)."""
        if self.seconds_left() != 0.0:
            return False
        self._skip(part)
        return True

    async def within_budget(self, awaitable: Awaitable[T], part: str) -> T | None:
        """The result of `awaitable`, or None when the budget is spent before it ends: it is cancelled then, and
        `part` is named in the report's `stopped` (its figures are left out, not reported half-taken)."""
        try:
            return await asyncio.wait_for(awaitable, self.seconds_left())
        except asyncio.TimeoutError:
            self._skip(part)
            return None

    def _skip(self, part: str) -> None:
        self.skipped.append(part)
        minutes = self.budget_s / 60 if self.budget_s is not None else 0.0
        stopped = {"reason": f"the time budget of {minutes:g} minutes was spent", "skipped": self.skipped}
        self.record(stopped=stopped)
        self.progress.say(f"time budget spent: {part} skipped")

    def finish(self, report: dict[str, Any] | None = None) -> dict[str, Any]:
        """The run has ended: `report` (the benchmark's figures) into the report, `complete` true unless a part was
        skipped, written; the report returned."""
        self.report["complete"] = not self.skipped
        self.record(**(report or {}))
        self.progress.close()
        return self.report

    def _write(self) -> None:
        self.report["run_s"] = round(self.clock() - self.started, 1)
        if self.out is None:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        # written beside and renamed over: a run killed while writing leaves the previous report, not half of one
        partial = self.out.with_name(self.out.name + ".partial")
        partial.write_text(json.dumps(self.report, indent=2))
        os.replace(partial, self.out)


def add_budget_option(parser: argparse.ArgumentParser, default_minutes: float) -> None:
    """`--budget-minutes`: the run's time budget (0: none)."""
    budget_help = (
        f"stop after this many minutes with the figures taken so far (the JSON says what was skipped; "
        f"0: no budget; default {default_minutes:g})"
    )
    parser.add_argument("--budget-minutes", type=float, default=default_minutes, help=budget_help)
