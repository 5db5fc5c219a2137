"""`benchmarks.late_short`'s figures from its streams' results, without a server."""

from __future__ import annotations

import pytest

from benchmarks.late_short import late_short_figures
from benchmarks.streams import StreamResult
from serve_app.bench.timing import FailedMeasurements


def _probe(short_ttfa_s: float | None, underruns: tuple[int, ...] = (0, 0)) -> tuple[StreamResult, list[StreamResult]]:
    short = StreamResult("short", ok=short_ttfa_s is not None, ttfa_s=short_ttfa_s)
    return short, [StreamResult("long", ok=True, ttfa_s=1.0, underruns=count) for count in underruns]


def test_the_ratio_is_each_probes_first_audio_over_the_idle_median_and_says_whether_it_is_within_3x() -> None:
    failed = FailedMeasurements()
    figures = late_short_figures([0.2, 0.1, 0.3], [_probe(0.5), _probe(0.7, (1, 2)), _probe(0.6)], failed)
    assert figures["idle_ttfa_s"] == 0.2
    assert figures["late_short_ttfa_ratio"] == pytest.approx(3.0)  # 0.6 / 0.2, the median probe
    assert figures["late_short_ttfa_ratio_spread"]["min"] == pytest.approx(2.5)
    assert figures["late_short_within_3x"] is True and figures["late_long_underruns"] == 0.0
    assert figures["late_long_underruns_spread"]["max"] == 3.0 and not failed.entries

    slower = late_short_figures([0.2, 0.2, 0.2], [_probe(0.61), _probe(0.8), _probe(0.9)], FailedMeasurements())
    assert slower["late_short_within_3x"] is False


def test_a_probe_without_first_audio_or_no_probe_leaves_the_ratio_null() -> None:
    lost = late_short_figures([0.2, 0.2, 0.2], [_probe(0.5), _probe(None)], FailedMeasurements())
    assert lost["late_short_ttfa_ratio"] is None and "late_short_within_3x" not in lost
    none = late_short_figures([0.2, 0.2, 0.2], [], FailedMeasurements())  # the time budget left no probe
    assert none["late_short_ttfa_ratio"] is None and none["idle_ttfa_s"] == 0.2
