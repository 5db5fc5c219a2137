"""How every benchmark figure is taken, in one place: untimed warm-up calls first, then `repeats` timed ones, reported
as the median with its spread; and the physical bound a derived figure (a ratio, an efficiency) must stay within
to count as a measurement at all.

The JSON shape, the same in every benchmark: a figure's key holds its median (null for a failed measurement) and
`<key>_spread` beside it holds `{"min", "max", "n"}` of the repeats. A figure outside its bound is listed in the
report's `failed_measurements` (its name, raw value, samples, bound and why) instead of being reported.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

DEFAULT_REPEATS = 3
DEFAULT_WARMUP = 1
# Why a bound holds, quoted in a failed measurement.
BATCH_RATIO_BOUND = "batch N cannot deliver more than N times the throughput of batch 1, nor less than 0"

T = TypeVar("T")


@dataclass(frozen=True)
class Timing:
    """The values of one figure over its repeats (seconds, or a figure derived from them repeat by repeat)."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a Timing needs at least one sample")

    @property
    def median(self) -> float:
        return float(statistics.median(self.samples))

    @property
    def min(self) -> float:
        return float(min(self.samples))

    @property
    def max(self) -> float:
        return float(max(self.samples))

    @property
    def n(self) -> int:
        return len(self.samples)

    def spread(self) -> dict[str, float | int]:
        return {"min": self.min, "max": self.max, "n": self.n}

    def fields(self, name: str) -> dict[str, Any]:
        """`{name: median, name_spread: {min, max, n}}`: the report shape of one figure."""
        return {name: self.median, f"{name}_spread": self.spread()}

    def map(self, fn: Callable[[float], float]) -> Timing:
        """The figure `fn(sample)` of each repeat (e.g. audio seconds / wall seconds)."""
        return Timing(tuple(fn(s) for s in self.samples))


def paired(fn: Callable[..., float], *timings: Timing) -> Timing:
    """`fn` of the i-th samples of each timing, repeat by repeat (a ratio or a sum of figures taken as often)."""
    return Timing(tuple(fn(*values) for values in zip(*(t.samples for t in timings), strict=True)))


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN (a failed measurement, never a result) for a zero denominator."""
    return numerator / denominator if denominator else math.nan


def measure(
    fn: Callable[[], T],
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[T, Timing]:
    """Call `fn` `warmup` times untimed (first-call costs: allocation, kernel choice, caches), then `repeats` times
    timed -> (the last call's result, the seconds of the timed calls)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        started = clock()
        result = fn()
        seconds.append(clock() - started)
    return result, Timing(tuple(seconds))


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else repr(value)  # JSON has no NaN or inf


@dataclass
class FailedMeasurements:
    """The derived figures of one report that fell outside their physical bound: each is reported as null and
    listed here (the report's `failed_measurements`), and printed when it happens."""

    entries: list[dict[str, Any]] = field(default_factory=list)

    def bounded(self, name: str, value: float, low: float, high: float, why: str) -> float | None:
        """`value` if it lies within [low, high], else None with the failure recorded."""
        if math.isfinite(value) and low <= value <= high:
            return value
        self._record(name, value, None, low, high, why)
        return None

    def bounded_fields(
        self, name: str, timing: Timing, low: float, high: float, why: str, key: str | None = None
    ) -> dict[str, Any]:
        """`timing.fields(key)` if its median lies within [low, high], else both keys null with the failure
        recorded under `name`, its samples included (`key`: the figure's key in its own dict, default `name`;
        `name` says where it sits in the report)."""
        key = name if key is None else key
        if math.isfinite(timing.median) and low <= timing.median <= high:
            return timing.fields(key)
        self._record(name, timing.median, timing.samples, low, high, why)
        return {key: None, f"{key}_spread": None}

    def _record(
        self, name: str, value: float, samples: tuple[float, ...] | None, low: float, high: float, why: str
    ) -> None:
        bound = [_json_number(low), _json_number(high)]
        entry: dict[str, Any] = {"name": name, "value": _json_number(value), "bound": bound, "why": why}
        if samples is not None:
            entry["samples"] = [_json_number(s) for s in samples]
        self.entries.append(entry)
        print(f"FAILED MEASUREMENT {name} = {value:.4g}, outside [{low:g}, {high:g}]: {why}", file=sys.stderr)


def add_repeat_options(parser: argparse.ArgumentParser) -> None:
    """`--repeats` and `--warmup`, the same in every benchmark."""
    repeats_help = "timed runs per figure (at least 1): their median and spread are reported"
    parser.add_argument("--repeats", type=_count(1), default=DEFAULT_REPEATS, help=repeats_help)
    warmup_help = "untimed runs before each figure's timed ones"
    parser.add_argument("--warmup", type=_count(0), default=DEFAULT_WARMUP, help=warmup_help)


def _count(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return parse
