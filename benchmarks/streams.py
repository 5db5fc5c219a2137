"""Streams under load: the decoder loop's playback-deadline policy against first-come order, side by side.

For each policy (`fcfs`, then `deadline`: the app's `scheduler.policy`) one local Serve app is started and sent the
same load: the idle time to first audio (TTFA) of short and long streams one at a time; the late-short scenario (7
long streams, one second later a short one: its TTFA over idle, the long streams' underruns); and seeded open-loop
Poisson arrivals of `--arrivals` streams at each of `--rates`. Every client is a virtual listener (`Listener`), and a
policy *holds* a rate when every stream ended ok, none underran and the p95 TTFA ratio is at most 3
(docs/performance.md, "Streams under load", defines these). Headline keys: `held_rate_<policy>`, `held_rate_ratio`
(deadline / fcfs, `held_rate_ratio_reason` when null, `held_rate_ratio_above` when fcfs holds no rate),
`late_short_ttfa_ratio_<policy>`, `late_long_underruns_<policy>`, and `targets`.

    python -m benchmarks.streams --model tiny --out out/streams_tiny.json [--rates 0.3 0.6 1.2 2.4] [--arrivals 30]
        [--long-sentences 8] [--repeats 3] [--warmup 1] [--num-gpus 0] [--budget-minutes 14]

Writes the JSON (as it goes) and a PNG beside it. The default run ends within 15 minutes on the 2-core machine: a
part the time budget (`--budget-minutes`, 0: none) leaves no time for is left out, named in `stopped`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from serve_app.bench.http_load import BENCH_APP, PCM_BYTES_PER_SAMPLE, local_server
from serve_app.bench.progress import BenchmarkRun, add_budget_option
from serve_app.bench.timing import DEFAULT_REPEATS, DEFAULT_WARMUP, FailedMeasurements, Timing, add_repeat_options

POLICIES = ("fcfs", "deadline")
LONG_SENTENCE = "This is a much longer request that keeps the decoder busy for a while."
LONG_SENTENCES = 8  # the long text of the scenario the deadline order was built for
SHORT_TEXTS = ("Hi there.", "Hello.", "Good morning.", "Thank you.")
LATE_SHORT_TEXT = SHORT_TEXTS[0]
LATE_LONG_STREAMS = 7
LATE_SHORT_DELAY_S = 1.0
TTFA_RATIO_BOUND = 3.0  # a held rate's p95 TTFA is at most this x the idle TTFA
MIN_IDLE_SAMPLES = 3
TARGET_HELD_RATE_RATIO = 1.5
# The default workload ran 17 minutes here on a machine shared with other work: the budget keeps a default run within
# 15 minutes, the parts it cuts named in the JSON (`--budget-minutes 0`: none).
BUDGET_MINUTES = 14.0
KINDS = ("short", "long")


@dataclass(frozen=True)
class StreamsWorkload:
    rates: tuple[float, ...] = (0.3, 0.6, 1.2, 2.4)  # streams per second, doubling: fcfs fails within them on tiny
    # Streams per rate: enough that at the top rates the loop fills (on tiny, 10 was a burst over before the slots
    # were full, where both policies do the same work) and that the p95 is not simply the slowest stream.
    arrivals: int = 30
    long_fraction: float = 0.5  # of the arrivals, drawn with the seed
    long_sentences: int = LONG_SENTENCES  # fewer: a cheaper run (a check), no longer the standard workload
    seed: int = 26
    jitter_buffer_s: float = 0.3
    repeats: int = DEFAULT_REPEATS  # of the late-short scenario (and idle samples, at least 3)
    warmup: int = DEFAULT_WARMUP
    request_timeout_s: float = 300.0  # one stream, from its request to its last byte
    drain_timeout_s: float = 180.0  # after a rate's last arrival: streams still running are cancelled (errors)

    @property
    def long_text(self) -> str:
        return " ".join([LONG_SENTENCE] * self.long_sentences)

    @property
    def idle_samples(self) -> int:
        return max(MIN_IDLE_SAMPLES, self.repeats)


@dataclass
class Listener:
    """A client playing its stream at 1x from `jitter_buffer_s` after its first audio (times in seconds)."""

    jitter_buffer_s: float
    first_at: float | None = None
    runs_out_at: float = 0.0  # when the listener has played everything received so far
    audio_s: float = 0.0
    underruns: int = 0

    def receive(self, at: float, seconds: float) -> None:
        """`seconds` of audio arrived at `at`."""
        if self.first_at is None:
            self.first_at = at
            self.runs_out_at = at + self.jitter_buffer_s
        elif at > self.runs_out_at:  # it ran out before this piece came: it plays again from now on
            self.underruns += 1
            self.runs_out_at = at
        self.runs_out_at += seconds
        self.audio_s += seconds


@dataclass
class StreamResult:
    kind: str  # short | long
    ok: bool
    ttfa_s: float | None = None  # request sent -> first audio byte
    underruns: int = 0
    total_s: float = 0.0
    audio_s: float = 0.0
    error: str = ""


def poisson_arrivals(rate: float, count: int, long_fraction: float, seed: int) -> list[tuple[float, str]]:
    """`count` (offset seconds from the first arrival, kind) of a Poisson process of `rate` per second, each
    arrival long with probability `long_fraction`; the same for the same arguments (both policies get them)."""
    rng = random.Random(f"{seed}/{rate!r}")
    offset, arrivals = 0.0, []
    for _ in range(count):
        arrivals.append((offset, "long" if rng.random() < long_fraction else "short"))
        offset += rng.expovariate(rate)
    return arrivals


async def stream_request(
    client: httpx.AsyncClient,
    text: str,
    kind: str,
    sample_rate: int,
    jitter_buffer_s: float,
    timeout_s: float,
    seed: int,
    first_audio_only: bool = False,
) -> StreamResult:
    """One streaming `/v1/tts` request (16-bit PCM) played by a `Listener`; `first_audio_only`: close it once its
    first audio came."""
    listener = Listener(jitter_buffer_s)
    body = {"text": text, "stream": True, "format": "pcm", "seed": seed}
    started = time.perf_counter()

    async def receive() -> StreamResult | None:
        async with client.stream("POST", "/v1/tts", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return StreamResult(kind, ok=False, error=f"{response.status_code}: {response.text[:200]}")
            async for piece in response.aiter_bytes():
                if piece:
                    seconds = len(piece) / PCM_BYTES_PER_SAMPLE / sample_rate
                    listener.receive(time.perf_counter() - started, seconds)
                    if first_audio_only:
                        return None
        return None

    try:
        failed = await asyncio.wait_for(receive(), timeout_s)
    except (httpx.HTTPError, TimeoutError) as exc:
        failed = StreamResult(kind, ok=False, error=f"{type(exc).__name__}: {exc}")
    total_s = time.perf_counter() - started
    if failed is not None:
        failed.ttfa_s, failed.underruns, failed.total_s = listener.first_at, listener.underruns, total_s
        return failed
    ok = listener.first_at is not None
    return StreamResult(
        kind,
        ok=ok,
        ttfa_s=listener.first_at,
        underruns=listener.underruns,
        total_s=total_s,
        audio_s=listener.audio_s,
        error="" if ok else "no audio",
    )


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


@dataclass
class RateResult:
    rate: float
    streams: int
    served: int  # ended ok
    errors: int
    underruns: int
    underruns_per_stream: float
    ttfa_p50_s: float | None
    ttfa_p95_s: float | None
    ttfa_ratio_p95: float | None  # p95 of each stream's TTFA / the idle TTFA of its kind
    holds: bool
    wall_s: float
    error_examples: list[str] = field(default_factory=list)
    stream_results: list[dict[str, Any]] = field(default_factory=list)


def summarize_rate(
    rate: float, results: list[StreamResult], idle_ttfa_s: dict[str, float], wall_s: float
) -> RateResult:
    """One rate's figures, and whether the policy holds it (every stream ok, no underrun, p95 TTFA ratio <= 3)."""
    served = [r for r in results if r.ok]
    underruns = sum(r.underruns for r in results)
    ttfas = [r.ttfa_s for r in results if r.ttfa_s is not None]
    ratios = [r.ttfa_s / idle_ttfa_s[r.kind] for r in results if r.ttfa_s is not None]
    ratio_p95 = percentile(ratios, 95)
    errors = len(results) - len(served)
    holds = errors == 0 and underruns == 0 and ratio_p95 is not None and ratio_p95 <= TTFA_RATIO_BOUND
    return RateResult(
        rate=rate,
        streams=len(results),
        served=len(served),
        errors=errors,
        underruns=underruns,
        underruns_per_stream=underruns / len(results) if results else 0.0,
        ttfa_p50_s=percentile(ttfas, 50),
        ttfa_p95_s=percentile(ttfas, 95),
        ttfa_ratio_p95=ratio_p95,
        holds=holds,
        wall_s=wall_s,
        error_examples=sorted({r.error for r in results if not r.ok})[:5],
        stream_results=[asdict(r) for r in results],
    )


def held_rate(levels: Sequence[RateResult]) -> float | None:
    """The highest rate such that it and every lower rate hold; None when the lowest rate fails."""
    held = None
    for level in sorted(levels, key=lambda level: level.rate):
        if not level.holds:
            break
        held = level.rate
    return held


def held_rate_figures(levels_by_policy: dict[str, list[RateResult]]) -> dict[str, Any]:
    """`held_rate_<policy>` (with `_below` where the lowest rate fails) and `held_rate_ratio` (deadline / fcfs) with
    why it is null, or a lower bound, where it is."""
    figures: dict[str, Any] = {}
    for policy, levels in levels_by_policy.items():
        figures[f"held_rate_{policy}"] = held_rate(levels)
        if figures[f"held_rate_{policy}"] is None and levels:
            figures[f"held_rate_{policy}_below"] = min(level.rate for level in levels)  # it holds less than this
    fcfs, deadline = figures.get("held_rate_fcfs"), figures.get("held_rate_deadline")
    top = {policy: max((level.rate for level in levels), default=None) for policy, levels in levels_by_policy.items()}
    ratio, reason = None, None
    unmeasured = [policy for policy in POLICIES if not levels_by_policy.get(policy)]
    if unmeasured:
        reason = f"no rate was measured for {', '.join(unmeasured)} (the time budget cut it: see `stopped`)"
    elif fcfs is None:
        reason = f"fcfs holds no rate tried (it fails the lowest, {figures.get('held_rate_fcfs_below')} streams/s)"
    elif fcfs == top.get("fcfs"):
        reason = f"fcfs holds every rate tried (up to {fcfs} streams/s): its limit was not reached"
    elif deadline is None:
        reason = f"deadline holds no rate tried while fcfs holds {fcfs} streams/s: the ratio is below 1"
    else:
        ratio = deadline / fcfs
    figures["held_rate_ratio"] = ratio
    figures["held_rate_ratio_reason"] = reason
    # fcfs holds less than its lowest rate, deadline at least its held one: the ratio is above their quotient
    bound = (
        deadline / figures["held_rate_fcfs_below"] if not unmeasured and fcfs is None and deadline is not None else None
    )
    figures["held_rate_ratio_above"] = bound
    # deadline holding the highest rate tried: its real limit is higher, so the ratio is a lower bound
    figures["held_rate_ratio_is_lower_bound"] = (
        ratio is not None and deadline is not None and deadline == top.get("deadline")
    )
    return figures


@dataclass(frozen=True)
class Level:
    """One rate's streams, before the idle TTFA they are measured against is known."""

    rate: float
    results: list[StreamResult]
    wall_s: float


class Run:
    """One policy's server: its client, sample rate and the run's progress."""

    def __init__(
        self, client: httpx.AsyncClient, sample_rate: int, workload: StreamsWorkload, bench: BenchmarkRun
    ) -> None:
        self.client, self.sample_rate, self.workload, self.bench = client, sample_rate, workload, bench
        self.seeds = 0

    def text_for(self, kind: str, index: int) -> str:
        return self.workload.long_text if kind == "long" else SHORT_TEXTS[index % len(SHORT_TEXTS)]

    async def stream(self, kind: str, text: str, first_audio_only: bool = False) -> StreamResult:
        self.seeds += 1  # the same sequence of seeds under both policies
        workload = self.workload
        return await stream_request(
            self.client,
            text,
            kind,
            self.sample_rate,
            workload.jitter_buffer_s,
            workload.request_timeout_s,
            self.seeds,
            first_audio_only,
        )

    async def idle(self, kinds: tuple[str, ...] = KINDS) -> dict[str, list[float]]:
        """The idle TTFAs of each of `kinds` (one request at a time, after the warm-up)."""
        for index in range(self.workload.warmup):
            for kind in kinds:
                await self.stream(kind, self.text_for(kind, index), first_audio_only=kind == "long")
        samples: dict[str, list[float]] = {}
        for kind in kinds:
            samples[kind] = []
            for _ in range(self.workload.idle_samples):
                result = await self.stream(kind, self.text_for(kind, 0), kind == "long")
                self.bench.step(f"idle {kind}")
                if result.ttfa_s is None:
                    raise RuntimeError(f"an idle {kind} stream gave no audio: {result.error}")
                samples[kind].append(result.ttfa_s)
        return samples

    async def late_short(self) -> tuple[StreamResult, list[StreamResult]]:
        """7 long streams, then one second later a short one -> the short one, the long ones (run to their end)."""
        longs = [asyncio.create_task(self.stream("long", self.text_for("long", 0))) for _ in range(LATE_LONG_STREAMS)]
        try:
            await asyncio.sleep(LATE_SHORT_DELAY_S)
            short = await self.stream("short", LATE_SHORT_TEXT)
            long_results = await asyncio.gather(*longs)
        finally:  # when the time budget cuts the probe, its long streams do not run on into the next part
            for task in longs:
                task.cancel()
        self.bench.step("late short")
        return short, list(long_results)

    async def rate_level(self, rate: float) -> Level:
        """`arrivals` streams at the seeded Poisson times of `rate`; streams still running `drain_timeout_s` after
        the last arrival are cancelled and count as errors."""
        workload = self.workload
        arrivals = poisson_arrivals(rate, workload.arrivals, workload.long_fraction, workload.seed)
        started = time.perf_counter()
        tasks = []
        try:
            for index, (offset, kind) in enumerate(arrivals):
                await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
                task = asyncio.create_task(self.stream(kind, self.text_for(kind, index)))
                task.add_done_callback(lambda _, rate=rate: self.bench.step(f"{rate:g}/s"))
                tasks.append(task)
            await asyncio.wait(tasks, timeout=workload.drain_timeout_s)
        except asyncio.CancelledError:  # the time budget cut the rate: none of its streams runs on
            for task in tasks:
                task.cancel()
            raise
        results = []
        for task, (_, kind) in zip(tasks, arrivals, strict=True):
            if task.done():
                results.append(task.result())
            else:
                task.cancel()
                results.append(
                    StreamResult(
                        kind, ok=False, error=f"still running {workload.drain_timeout_s} s after the last arrival"
                    )
                )
        await asyncio.gather(*tasks, return_exceptions=True)
        return Level(rate, results, time.perf_counter() - started)


def late_short_probe(short: StreamResult, longs: list[StreamResult], idle_short_ttfa_s: float) -> dict[str, Any]:
    """One late-short repeat: the short stream's TTFA / its idle TTFA, the long streams' underruns."""
    return {
        "short": asdict(short),
        "ttfa_ratio": short.ttfa_s / idle_short_ttfa_s if short.ttfa_s is not None else None,
        "long_underruns": sum(r.underruns for r in longs),
        "long_errors": sum(not r.ok for r in longs),
        "long_ttfa_s": [r.ttfa_s for r in longs],
        "long_total_s": [r.total_s for r in longs],
    }


def scenario_figures(policy: str, probes: list[dict[str, Any]], failed: FailedMeasurements) -> dict[str, Any]:
    """The late-short figures of one policy over its repeats: the median with its spread (null when a repeat's
    short stream gave no audio)."""
    figures: dict[str, Any] = {}
    ratios = [probe["ttfa_ratio"] for probe in probes]
    key = f"late_short_ttfa_ratio_{policy}"
    if None in ratios:
        figures |= {key: None, f"{key}_spread": None}
    else:
        why = "a time to first audio and its idle one are positive and finite"
        figures |= failed.bounded_fields(key, Timing(tuple(ratios)), 0.0, math.inf, why)
    ttfas = [probe["short"]["ttfa_s"] for probe in probes]
    ttfa_key = f"late_short_ttfa_s_{policy}"
    figures |= Timing(tuple(ttfas)).fields(ttfa_key) if None not in ttfas else {ttfa_key: None}
    figures |= Timing(tuple(float(probe["long_underruns"]) for probe in probes)).fields(f"late_long_underruns_{policy}")
    return figures


def held_rate_target(ratio: float | None, above: float | None) -> bool | None:
    """Whether deadline holds at least 1.5x the rate of fcfs: from the ratio, or from a bound it is known to
    exceed (fcfs holding no rate tried); None when neither tells."""
    if ratio is not None:
        return ratio >= TARGET_HELD_RATE_RATIO
    if above is not None and above >= TARGET_HELD_RATE_RATIO:
        return True
    return None


def targets(report: dict[str, Any]) -> dict[str, bool | None]:
    """The deadline order's targets (docs/performance.md, "Streams under load"), met or not (None: not measured)."""
    ratio = report["held_rate_ratio"]
    late = report.get("late_short_ttfa_ratio_deadline")
    fcfs_underruns, deadline_underruns = (
        report.get("late_long_underruns_fcfs"),
        report.get("late_long_underruns_deadline"),
    )
    return {
        "held_rate_ratio_at_least_1_5": held_rate_target(ratio, report.get("held_rate_ratio_above")),
        "late_short_within_3x_idle_deadline": None if late is None else late <= TTFA_RATIO_BOUND,
        "late_long_underruns_no_worse_than_fcfs": None
        if fcfs_underruns is None or deadline_underruns is None
        else deadline_underruns <= fcfs_underruns,
    }


async def policy_run(
    url: str,
    workload: StreamsWorkload,
    bench: BenchmarkRun,
    policy: str,
    run: dict[str, Any],
    publish: Callable[[], None],
) -> None:
    """One policy's parts into `run` ("idle", "late_short", "levels"), `publish` called after each; a part the time
    budget cuts is left out and named, and so is every part after it (`BenchmarkRun.within_budget`)."""
    limits = httpx.Limits(max_connections=workload.arrivals + LATE_LONG_STREAMS + 4)
    async with httpx.AsyncClient(base_url=url, timeout=workload.request_timeout_s, limits=limits) as client:
        voices = await client.get("/v1/voices")
        voices.raise_for_status()
        streams = Run(client, int(voices.json()["sample_rate"]), workload, bench)
        run["late_short"], run["levels"] = [], []
        idle = await bench.within_budget(streams.idle(), f"{policy} idle")
        if idle is not None:
            run["idle"] = idle
            publish()
        for repeat in range(workload.repeats):
            probe = await bench.within_budget(streams.late_short(), f"{policy} late short {repeat + 1}")
            if probe is not None:
                run["late_short"].append(probe)
                publish()
        for rate in workload.rates:
            level = await bench.within_budget(streams.rate_level(rate), f"{policy} {rate:g}/s")
            if level is not None:
                run["levels"].append(level)
                publish()


def app_args_for(policy: str, num_gpus: float) -> dict[str, Any]:
    return {"scheduler": {"policy": policy}, "decoder": {"num_gpus": num_gpus}}


def measure_policies(
    model: str, workload: StreamsWorkload, bench: BenchmarkRun, num_gpus: float = 0.0
) -> dict[str, Any]:
    """Both policies, one local Serve app each, the same load -> the report (`bench`'s report holds it so far after
    each part: the figures of the parts that ran)."""
    from ray import serve

    per_policy = len(workload.rates) * workload.arrivals + 2 * workload.idle_samples + workload.repeats
    bench.plan(len(POLICIES) * per_policy)
    bench.record(setup=setup_fields(model, workload, num_gpus))
    runs: dict[str, dict[str, Any]] = {}

    def publish() -> None:
        bench.record(**policies_report(runs))

    for policy in POLICIES:
        runs[policy] = {}
        if bench.out_of_time(policy):  # its server's start is not worth paying for nothing
            continue
        with bench.phase(policy), local_server(model, app_args_for(policy, num_gpus)) as url:
            asyncio.run(policy_run(url, workload, bench, policy, runs[policy], publish))
            runs[policy]["decoder_stats"] = (
                serve.get_deployment_handle("Decoder", BENCH_APP).batch_stats.remote().result()
            )
        publish()
    return policies_report(runs)


def policies_report(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report of the policies' parts so far (`policy_run`'s "idle", "late_short", "levels" and the decoder's
    stats, each where it ran)."""
    measured = {policy: run for policy, run in runs.items() if "idle" in run}
    if not measured:
        return {}
    # Both policies are measured against one idle TTFA per kind, pooled over both servers: with one request at a
    # time the policies do the same work, and on a shared machine two medians taken minutes apart differ by more
    # than the policy does (0.13 against 0.20 s in one run).
    idle = {kind: Timing(tuple(t for run in measured.values() for t in run["idle"][kind])) for kind in KINDS}
    idle_ttfa_s = {kind: timing.median for kind, timing in idle.items()}
    levels = {
        policy: [summarize_rate(lv.rate, lv.results, idle_ttfa_s, lv.wall_s) for lv in run.get("levels", [])]
        for policy, run in measured.items()
    }
    probes = {
        policy: [late_short_probe(short, longs, idle_ttfa_s["short"]) for short, longs in run.get("late_short", [])]
        for policy, run in measured.items()
    }
    failed = FailedMeasurements()
    report: dict[str, Any] = held_rate_figures(levels)
    for kind, timing in idle.items():
        report |= timing.fields(f"idle_ttfa_s_{kind}")
    for policy, policy_probes in probes.items():
        if policy_probes:
            report |= scenario_figures(policy, policy_probes, failed)
    report["targets"] = targets(report)
    report["failed_measurements"] = failed.entries
    report["policies"] = {
        policy: {
            **{f"idle_ttfa_s_{kind}_samples": samples for kind, samples in run["idle"].items()},
            "levels": [asdict(level) for level in levels[policy]],
            "late_short": probes[policy],
            "decoder_stats": {
                k: run["decoder_stats"].get(k)
                for k in ("policy", "preempted", "resumed", "held_for_first_audio", "admitted")
            }
            if "decoder_stats" in run
            else None,
        }
        for policy, run in measured.items()
    }
    return report


def setup_fields(model: str, workload: StreamsWorkload, num_gpus: float) -> dict[str, Any]:
    return {
        "model": model,
        "workload": asdict(workload),
        "long_text": workload.long_text,
        "short_texts": list(SHORT_TEXTS),
        "app_args": {policy: app_args_for(policy, num_gpus) for policy in POLICIES},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{'policy':<9}{'rate/s':>7}{'served':>8}{'err':>5}{'underruns/stream':>18}{'ttfa p50':>10}{'p95':>8}"
        f"{'p95 ratio':>10}{'holds':>7}"
    )
    for policy, run in report["policies"].items():
        for level in run["levels"]:
            p50, p95, ratio = (
                level[k] if level[k] is not None else math.nan for k in ("ttfa_p50_s", "ttfa_p95_s", "ttfa_ratio_p95")
            )
            print(
                f"{policy:<9}{level['rate']:>7g}{level['served']:>5}/{level['streams']:<2}{level['errors']:>5}"
                f"{level['underruns_per_stream']:>18.2f}{p50:>10.2f}{p95:>8.2f}{ratio:>10.2f}"
                f"{'yes' if level['holds'] else 'no':>7}"
            )


def held_rate_title(report: dict[str, Any]) -> str:
    def held(policy: str) -> str:
        rate, below = report.get(f"held_rate_{policy}"), report.get(f"held_rate_{policy}_below")
        if rate is not None:
            return f"{policy} {rate:g}/s"
        return f"{policy} < {below:g}/s" if below is not None else f"{policy} not measured"  # the budget cut it

    text = ", ".join(held(policy) for policy in POLICIES)
    if report["held_rate_ratio"] is not None:
        return f"held rate: {text}; deadline / fcfs {report['held_rate_ratio']:.2g}"
    if report.get("held_rate_ratio_above") is not None:
        return f"held rate: {text}; deadline / fcfs > {report['held_rate_ratio_above']:.2g}"
    return f"held rate: {text}"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, (ttfa_axis, underrun_axis, late_axis) = plt.subplots(1, 3, figsize=(15, 4.5))
    rates: list[float] = []
    for policy, run in report["policies"].items():
        rates = [level["rate"] for level in run["levels"]]
        ratios = [level["ttfa_ratio_p95"] or math.nan for level in run["levels"]]
        ttfa_axis.plot(rates, ratios, "-o", label=policy)
        underrun_axis.plot(rates, [level["underruns_per_stream"] for level in run["levels"]], "-o", label=policy)
    ttfa_axis.axhline(TTFA_RATIO_BOUND, color="grey", linestyle=":", label=f"{TTFA_RATIO_BOUND:g}x idle (holds below)")
    ttfa_axis.set(yscale="log", ylabel="p95 of TTFA / idle TTFA", title="Time to first audio")
    underrun_axis.set(ylabel="underruns per stream", title="Underruns (listener, 0.3 s jitter buffer)")
    for axis in (ttfa_axis, underrun_axis):
        axis.set_xscale("log")
        axis.set_xticks(rates, [f"{rate:g}" for rate in rates])
        axis.minorticks_off()
        axis.set_xlabel("Poisson arrivals per second")
        axis.legend()
    ratios = [report.get(f"late_short_ttfa_ratio_{policy}") or math.nan for policy in POLICIES]
    bars = late_axis.bar(range(len(POLICIES)), ratios, width=0.5)
    late_axis.bar_label(bars, fmt="%.3g")
    late_axis.axhline(TTFA_RATIO_BOUND, color="grey", linestyle=":", label=f"target {TTFA_RATIO_BOUND:g}x")
    labels = [f"{policy}\nlong streams' underruns {report.get(f'late_long_underruns_{policy}')}" for policy in POLICIES]
    late_axis.set_xticks(range(len(POLICIES)), labels)
    late_axis.set(
        yscale="log",
        ylabel="short stream's TTFA / its idle TTFA",
        title=f"{LATE_LONG_STREAMS} long streams + 1 short {LATE_SHORT_DELAY_S:g} s later (median)",
    )
    late_axis.legend()
    figure.suptitle(f"{report['setup']['model']}: {held_rate_title(report)}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def headline(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in ("policies", "setup")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="tiny")
    defaults = StreamsWorkload()
    parser.add_argument("--rates", type=float, nargs="+", default=list(defaults.rates), help="streams per second")
    parser.add_argument("--arrivals", type=int, default=defaults.arrivals, help="streams per rate")
    parser.add_argument("--long-fraction", type=float, default=defaults.long_fraction)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    sentences_help = "sentences of the long text (default 8, the standard workload; fewer makes a cheaper check)"
    parser.add_argument("--long-sentences", type=int, default=defaults.long_sentences, help=sentences_help)
    parser.add_argument("--jitter-buffer-s", type=float, default=defaults.jitter_buffer_s)
    timeout_help = "one stream's longest time, request to last byte"
    parser.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s, help=timeout_help)
    drain_help = "after a rate's last arrival, streams still running this long later are cancelled (errors)"
    parser.add_argument("--drain-timeout-s", type=float, default=defaults.drain_timeout_s, help=drain_help)
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPU fraction of the decoder replica")
    dry_help = "check the arguments and write the workload as JSON; start nothing (gpu_check.sh --quick)"
    parser.add_argument("--dry-run", action="store_true", help=dry_help)
    add_repeat_options(parser)
    add_budget_option(parser, BUDGET_MINUTES)
    options = parser.parse_args()
    if any(rate <= 0 for rate in options.rates) or options.arrivals < 1 or options.long_sentences < 1:
        parser.error("--rates must be positive, --arrivals and --long-sentences at least 1")
    if not 0 <= options.long_fraction <= 1 or options.jitter_buffer_s < 0:
        parser.error("--long-fraction must be in [0, 1] and --jitter-buffer-s at least 0")
    if options.request_timeout_s <= 0 or options.drain_timeout_s <= 0:
        parser.error("--request-timeout-s and --drain-timeout-s must be positive")
    workload = StreamsWorkload(
        rates=tuple(sorted(set(options.rates))),
        arrivals=options.arrivals,
        long_fraction=options.long_fraction,
        seed=options.seed,
        long_sentences=options.long_sentences,
        jitter_buffer_s=options.jitter_buffer_s,
        repeats=options.repeats,
        warmup=options.warmup,
        request_timeout_s=options.request_timeout_s,
        drain_timeout_s=options.drain_timeout_s,
    )
    options.out.parent.mkdir(parents=True, exist_ok=True)
    if options.dry_run:
        plan = {"dry_run": True, "model": options.model, "num_gpus": options.num_gpus, "workload": asdict(workload)}
        options.out.write_text(json.dumps(plan, indent=2, default=str))
        print(json.dumps(plan, default=str))
        return
    bench = BenchmarkRun("streams", options.out, options.budget_minutes)
    report = bench.finish(measure_policies(options.model, workload, bench, options.num_gpus))
    plot(report, options.out.with_suffix(".png"))
    print_table(report)
    print(json.dumps(headline(report), indent=2))
    print(f"wrote {options.out} and {options.out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
