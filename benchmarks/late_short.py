"""A late short request on a running server, as its user meets it: `benchmarks.streams`' late-short scenario sent to
the server at `--url` (what `cosyvoice-serve run` serves, with its own settings), not to a local app of the
benchmark's.

The idle time to first audio (TTFA) of short streams ("Hi there.") one at a time; then `--repeats` times, 7 long
streams start and one second later a short one: its TTFA / the idle TTFA, and the long streams' underruns (a virtual
listener each, `streams.Listener`). Headline keys: `late_short_ttfa_ratio` (median, `_spread` beside it),
`late_short_within_3x` (the goal), `idle_ttfa_s`, `late_short_ttfa_s`, `late_long_underruns`. The default run takes
about 2 minutes on the 2-core machine with the tiny model (Intel Xeon with AMX, 2026-12-07); the time budget
(`--budget-minutes`, default 14) cuts the repeats it leaves no time for, named in `stopped`.

    cosyvoice-serve run &
    python -m benchmarks.late_short --url http://127.0.0.1:8000 --out out/late_short.json [--repeats 3] [--warmup 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx

from benchmarks.streams import LATE_LONG_STREAMS, TTFA_RATIO_BOUND, Run, StreamResult, StreamsWorkload
from serve_app.bench.progress import BenchmarkRun, add_budget_option
from serve_app.bench.timing import FailedMeasurements, Timing, add_repeat_options

BUDGET_MINUTES = 14.0


def late_short_figures(
    idle_ttfa_s: list[float], probes: list[tuple[StreamResult, list[StreamResult]]], failed: FailedMeasurements
) -> dict[str, Any]:
    """The figures of the idle TTFAs and the late-short probes (each: the short stream, the long ones); a probe whose
    short stream gave no audio makes the ratio null."""
    idle = Timing(tuple(idle_ttfa_s))
    figures: dict[str, Any] = idle.fields("idle_ttfa_s")
    shorts = [short.ttfa_s for short, _ in probes]
    if not probes or None in shorts:
        return figures | {"late_short_ttfa_ratio": None, "late_short_ttfa_ratio_spread": None}
    why = "a time to first audio and its idle one are positive and finite"
    ratios = Timing(tuple(ttfa / idle.median for ttfa in shorts))
    figures |= failed.bounded_fields("late_short_ttfa_ratio", ratios, 0.0, math.inf, why)
    figures |= Timing(tuple(shorts)).fields("late_short_ttfa_s")
    underruns = Timing(tuple(float(sum(long.underruns for long in longs)) for _, longs in probes))
    figures |= underruns.fields("late_long_underruns")
    ratio = figures["late_short_ttfa_ratio"]
    figures["late_short_within_3x"] = None if ratio is None else ratio <= TTFA_RATIO_BOUND
    figures["long_stream_errors"] = [long.error for _, longs in probes for long in longs if not long.ok]
    return figures


async def measure(url: str, workload: StreamsWorkload, bench: BenchmarkRun) -> dict[str, Any]:
    """The idle TTFAs, then the late-short probes the time budget leaves time for -> the report's figures."""
    bench.plan(workload.idle_samples + workload.repeats)
    limits = httpx.Limits(max_connections=LATE_LONG_STREAMS + 4)
    async with httpx.AsyncClient(base_url=url, timeout=workload.request_timeout_s, limits=limits) as client:
        voices = await client.get("/v1/voices")
        voices.raise_for_status()
        streams = Run(client, int(voices.json()["sample_rate"]), workload, bench)
        bench.record(server=(await client.get("/v1/models")).json()["data"][0]["id"], url=url)
        idle = await streams.idle(kinds=("short",))
        probes = []
        for repeat in range(workload.repeats):
            probe = await bench.within_budget(streams.late_short(), f"late short {repeat + 1}")
            if probe is not None:
                probes.append(probe)
    failed = FailedMeasurements()
    return late_short_figures(idle["short"], probes, failed) | {"failed_measurements": failed.entries}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
    parser.add_argument("--out", type=Path, required=True)
    add_repeat_options(parser)
    add_budget_option(parser, BUDGET_MINUTES)
    options = parser.parse_args()
    workload = StreamsWorkload(repeats=options.repeats, warmup=options.warmup)
    bench = BenchmarkRun("late_short", options.out, options.budget_minutes)
    report = bench.finish(asyncio.run(measure(options.url.rstrip("/"), workload, bench)))
    keys = ("idle_ttfa_s", "late_short_ttfa_s", "late_short_ttfa_ratio", "late_short_ttfa_ratio_spread")
    print(json.dumps({key: report.get(key) for key in (*keys, "late_short_within_3x", "late_long_underruns")}))


if __name__ == "__main__":
    main()
