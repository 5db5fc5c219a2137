"""Side-by-side: this Ray Serve app against a baseline built like the official CosyVoice server, one run.

On 127.0.0.1, the same engine and weights: the engine's own decoder throughput at batch 1 and 8; the Ray Serve app
under closed loops of 1, 4 and 8 clients, Poisson arrivals, a late short stream, OpenAI's endpoint on a ~20 s text and
whole requests one at a time against in-process; and `benchmarks.baseline_server` (one request at a time). The load
is the model's profile (`PROFILES`, recorded as `setup.profile`); `--requests` and `--rates` override it. Medians of
`--repeats` with spreads, failed measurements null (`serve_app.bench.timing`). Headline keys: `throughput_ratio_c8`,
`batching_efficiency_c8`, `p50_ttfa_s`/`p95_ttfa_s`, `late_arrival_ttfa_ratio`, `overhead_ms_c1` (p50 of paired
differences, through Serve less in-process) and `openai_first_byte_fraction_20s`; what each means and the figures:
docs/history/performance-runs.md, "Continuous batching in the decoder replicas".

    python -m benchmarks.compare --out out/compare.json [--model tiny|dummy] [--requests N] [--rates R ...]
    python -m benchmarks.compare --out out/overhead.json --overhead-only   # only `overhead_ms_c1`
    python -m benchmarks.compare --out out/hops.json --hops-only   # plus a stream's first byte and 8 streams' bytes/s

Writes the JSON and a PNG beside it (none with the two `-only` modes). The default run (tiny) takes about 5 minutes
on the 2-core machine (286 s, Intel Xeon with AMX, 2026-12-07).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import torch
from ray import serve

from benchmarks.batching_bench import measure_batches
from benchmarks.engine_bench import fixed_length_segments
from engine.llm.sampling import SamplingOptions
from serve_app.bench.http_load import (
    BENCH_APP,
    PCM_BYTES_PER_SAMPLE,
    TEXTS,
    LevelResult,
    LevelRun,
    Sample,
    Workload,
    free_port,
    level_dict,
    local_server,
    one_request,
    percentiles,
    print_table,
    run_sweep,
    summarize,
    sweep_steps,
    wait_until_answering,
)
from serve_app.bench.progress import BenchmarkRun, add_budget_option
from serve_app.bench.timing import (
    BATCH_RATIO_BOUND,
    FailedMeasurements,
    Timing,
    add_repeat_options,
    paired,
    ratio,
)
from serve_app.exposure import process_title, process_tree

CLOSED_LOOP_CLIENTS = (1, 4, 8)
LATE_ARRIVAL_RUNNING = 7  # long streams already running when the short one arrives
LATE_ARRIVAL_LONG_RATIO = 10.0  # their speech tokens per text token, forced: ~8 s of audio each
BASELINE_THREADS = 1  # torch threads of the baseline and in-process runs: Ray gives a replica's torch 1
ENGINE_AUDIO_S = 2.0  # audio per request of the engine's own batch-1 / batch-8 measurement
OPENAI_AUDIO_S = 20.0
SHORT_TEXT, LONG_TEXT = TEXTS[0], TEXTS[-1]


@dataclass(frozen=True)
class Profile:
    """How much load the comparison sends (the texts are the workload's 1-, 2- and 4-sentence ones, at 3
    speech tokens per text token: 0.2 / 0.9 / 2.3 s of audio)."""

    requests: int  # per repeat: per closed-loop level, per Poisson rate, and request pairs of the overhead measure
    rates: tuple[float, ...]  # Poisson arrivals per second, one level each

    def workload(self, clients: tuple[int, ...], repeats: int, warmup: int) -> Workload:
        return replace(
            Workload(), concurrencies=clients, requests_per_level=self.requests, repeats=repeats, warmup=warmup
        )


# dummy: sized from the engine's RTF of ~5.5 at batch 1 on this 2-core CPU (~6 s per request of the mixed texts):
# an estimated 25-35 minutes per repeat on a quiet machine, the OpenAI ~20 s text and the late-arrival probe (its
# long streams are cancelled once it has measured) included.
# The default run (tiny) ends in about 5 minutes here; a bigger model's stops at this budget with what it measured
# unless given more (`--budget-minutes 0`: none), so that no default run outlasts 15 minutes.
BUDGET_MINUTES = 14.0
REPLICA_TITLE = "ray::ServeReplica:"  # a Serve replica's process title, before <app>:<deployment>
PROFILES = {"tiny": Profile(requests=16, rates=(0.5, 1.0)), "dummy": Profile(requests=16, rates=(0.25, 0.5))}


@contextmanager
def baseline_server(model: str, device: str, ready_timeout_s: float = 300.0) -> Iterator[str]:
    """Start `benchmarks.baseline_server` in a subprocess; yield its URL once it answers; stop it after."""
    port = free_port()
    command = [sys.executable, "-m", "benchmarks.baseline_server", "--model", model, "--port", str(port)]
    options = ["--threads", str(BASELINE_THREADS), "--device", device, "--dtype", dtype_for(device)]
    process = subprocess.Popen([*command, *options])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(f"{url}/v1/voices", process, "the baseline server", ready_timeout_s)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def in_process(
    tts: Any, compared: int, workload: Workload, failed: FailedMeasurements, bench: BenchmarkRun
) -> tuple[dict[str, Any], Timing | None]:
    """The engine alone: decoder throughput at batch 1 and `compared` (fixed-length requests), each the median of
    `workload.repeats` after `workload.warmup` untimed runs -> (the report's fields, the repeat-by-repeat ratio of
    the two throughputs: None, its keys null and its failure in `failed`, outside [0, compared])."""

    def segments(count: int) -> list[Any]:
        return fixed_length_segments(tts.encoder, ENGINE_AUDIO_S, count)

    batches = [1, compared]
    batching = measure_batches(tts.decoder, segments, batches, ENGINE_AUDIO_S, workload.repeats, workload.warmup, bench)
    rows = {row["batch"]: row["timings"]["decoder_throughput"] for row in batching["rows"]}
    engine_ratio = paired(ratio, rows[compared], rows[1])
    fields = {
        **rows[1].fields("decoder_throughput_b1"),
        **rows[compared].fields(f"decoder_throughput_b{compared}"),
        **failed.bounded_fields(
            "engine.decoder_ratio_vs_b1",
            engine_ratio,
            0.0,
            float(compared),
            BATCH_RATIO_BOUND,
            key="decoder_ratio_vs_b1",
        ),
    }
    return fields, None if fields["decoder_ratio_vs_b1"] is None else engine_ratio


def interleaved_overhead(url: str, tts: Any, workload: Workload, bench: BenchmarkRun) -> dict[str, Any] | None:
    """Whole requests one at a time, each in-process and then through Ray Serve, so that the load of a shared
    machine drifts over both alike; `workload.repeats` rounds of `requests_per_level` pairs after
    `workload.warmup` untimed pairs -> "ms": the median over the rounds of each round's p50 of the per-request
    differences in ms (with "ms_spread"), and the percentiles of all rounds' differences and latencies. A round
    the time budget cuts short is left out; None when no round ended."""
    voice = tts.voices[0]
    local, served, round_p50s = [], [], []

    def pair(http: httpx.Client, index: int) -> tuple[float, float]:
        body = {**workload.body(index, stream=False), "voice": voice}
        started = time.perf_counter()
        tts.synthesize(body["text"], voice, seed=body["seed"], **body.get("sampling", {}))
        alone = time.perf_counter() - started
        started = time.perf_counter()
        http.post("/v1/tts", json=body).raise_for_status()
        bench.step("overhead pair")
        return alone, time.perf_counter() - started

    with httpx.Client(base_url=url, timeout=workload.timeout_s) as http:
        for index in range(workload.warmup):
            pair(http, index)
        for round_ in range(workload.repeats):
            pairs: list[tuple[float, float]] = []
            while len(pairs) < workload.requests_per_level and not bench.out_of_time(f"overhead round {round_ + 1}"):
                pairs.append(pair(http, len(pairs)))
            if len(pairs) < workload.requests_per_level:
                break  # the budget cut this round short: it is left out
            round_p50s.append(percentiles([1000 * (ray - alone) for alone, ray in pairs])["p50"])
            local += [alone for alone, _ in pairs]
            served += [ray for _, ray in pairs]
    if not round_p50s:
        return None
    differences_ms = [1000 * (ray - alone) for ray, alone in zip(served, local, strict=True)]
    return {
        **Timing(tuple(round_p50s)).fields("ms"),
        "difference_ms": percentiles(differences_ms),
        "in_process_s": percentiles(local),
        "ray_serve_s": percentiles(served),
    }


def dtype_for(device: str) -> str:
    return "float16" if device == "cuda" else "float32"


def text_for_audio_seconds(tts: Any, seconds: float, max_token_text_ratio: float) -> str:
    """A text whose speech, at `max_token_text_ratio` tokens per text token, lasts about `seconds`
    (random weights rarely stop early: the ratio sets the length)."""
    frontend = tts.encoder.model.frontend
    words = (LONG_TEXT + " ") * 20
    wanted_tokens = tts.encoder.model.config.speech_tokens_for(seconds) / max_token_text_ratio
    text = ""
    for word in words.split():
        text = f"{text} {word}".strip()
        if len(frontend.tokenize(frontend.normalize(text))) >= wanted_tokens:
            break
    return text


async def poisson_level(
    client: httpx.AsyncClient, workload: Workload, rate: float, sample_rate: int, bench: BenchmarkRun
) -> LevelResult:
    """`workload.repeats` times: `requests_per_level` streaming requests whose arrivals are a Poisson process of
    `rate` per second (each repeat its own arrival times)."""
    rng = random.Random(int(rate * 1000))

    async def arrival(index: int) -> Sample:
        sample = await one_request(client, workload.body(index, stream=True), sample_rate)
        bench.step(f"poisson {rate:g}/s")
        return sample

    runs = []
    for _ in range(workload.repeats):
        tasks, started = [], time.perf_counter()
        try:
            for index in range(workload.requests_per_level):
                tasks.append(asyncio.create_task(arrival(index)))
                await asyncio.sleep(rng.expovariate(rate))
            samples = await asyncio.gather(*tasks)
        finally:  # when the time budget cuts the level, none of its requests runs on into the next part
            for task in tasks:
                task.cancel()
        runs.append(LevelRun(list(samples), time.perf_counter() - started))
    return summarize(f"poisson_{rate:g}", 0, runs)


async def late_arrival(
    client: httpx.AsyncClient, workload: Workload, sample_rate: int, bench: BenchmarkRun
) -> dict[str, Any] | None:
    """The late-arrival probe `workload.repeats` times (fewer where the time budget ends first; None if none ran)
    -> the median of each figure with its spread (a figure that some probe could not measure: null)."""
    probes = []
    for attempt in range(workload.repeats):
        probe = late_arrival_probe(client, workload, sample_rate, attempt)
        measured = await bench.within_budget(probe, f"late arrival probe {attempt + 1}")
        if measured is None:
            break
        probes.append(measured)
        bench.step("late arrival probe")
    if not probes:
        return None
    result: dict[str, Any] = {}
    for name in ("idle_ttfa_s", "late_ttfa_s", "ratio"):
        values = [probe[name] for probe in probes]
        result |= Timing(tuple(values)).fields(name) if None not in values else {name: None, f"{name}_spread": None}
    result["long_streams_streaming"] = [probe["long_streams_streaming"] for probe in probes]
    return result


async def late_arrival_probe(
    client: httpx.AsyncClient, workload: Workload, sample_rate: int, attempt: int
) -> dict[str, Any]:
    """First audio of a short stream on the idle server, then while 7 long streams are running (the number that
    gave audio: `long_streams_streaming`)."""

    def body(text: str, seed: int) -> dict[str, Any]:
        return {**workload.body(seed, stream=True), "text": text}

    seeds = 1000 * attempt  # each probe its own requests
    idle = [await one_request(client, body(SHORT_TEXT, seeds + 100 + i), sample_rate) for i in range(3)]
    first_bytes = [asyncio.Event() for _ in range(LATE_ARRIVAL_RUNNING)]
    streaming = [False] * LATE_ARRIVAL_RUNNING
    forced = {"min_token_text_ratio": LATE_ARRIVAL_LONG_RATIO, "max_token_text_ratio": LATE_ARRIVAL_LONG_RATIO}

    async def long_stream(index: int) -> None:
        long_body = {**body(LONG_TEXT, seeds + 200 + index), "sampling": forced}
        try:
            async with client.stream("POST", "/v1/tts", json=long_body) as response:
                async for piece in response.aiter_bytes():
                    if piece:
                        streaming[index] = True
                        first_bytes[index].set()
        finally:  # one that fails or ends before any audio must not hold the probe forever
            first_bytes[index].set()

    running = [asyncio.create_task(long_stream(i)) for i in range(LATE_ARRIVAL_RUNNING)]
    try:
        await asyncio.gather(*(event.wait() for event in first_bytes))  # all 7 are streaming (or failed)
        late = await one_request(client, body(SHORT_TEXT, seeds + 300), sample_rate)
    finally:  # what the long ones still had to decode is not needed: their clients leave
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    idle_ttfa = percentiles([s.first_chunk_s for s in idle if s.ok])["p50"]
    return {
        "idle_ttfa_s": idle_ttfa,
        "late_ttfa_s": late.first_chunk_s if late.ok else None,
        "ratio": late.first_chunk_s / idle_ttfa if late.ok and idle_ttfa else None,
        "long_streams_streaming": sum(streaming),
    }


async def openai_first_byte(
    client: httpx.AsyncClient, model_name: str, voice: str, text: str, repeats: int, bench: BenchmarkRun
) -> dict[str, Any] | None:
    """`openai_request` `repeats` times (fewer where the time budget ends first; None if none ran) -> the median of
    each figure, with its spread."""
    runs = []
    for attempt in range(repeats):
        run = await bench.within_budget(openai_request(client, model_name, voice, text), f"openai {attempt + 1}")
        if run is None:
            break
        runs.append(run)
        bench.step("openai 20 s")
    if not runs:
        return None
    result: dict[str, Any] = {}
    for name in ("first_byte_s", "total_s", "audio_s", "fraction"):
        result |= Timing(tuple(run[name] for run in runs)).fields(name)
    return result


async def openai_request(client: httpx.AsyncClient, model_name: str, voice: str, text: str) -> dict[str, Any]:
    """`POST /v1/audio/speech` (pcm, default stream_format): seconds to the first byte (the last, without any
    audio) and the last byte."""
    body = {"model": model_name, "input": text, "voice": voice, "response_format": "pcm"}
    started = time.perf_counter()
    first, size = None, 0
    async with client.stream("POST", "/v1/audio/speech", json=body) as response:
        response.raise_for_status()
        sample_rate = int(response.headers["x-sample-rate"])  # OpenAI's 24 kHz, whatever the model's rate
        async for piece in response.aiter_bytes():
            if piece and first is None:
                first = time.perf_counter() - started
            size += len(piece)
    total = time.perf_counter() - started
    audio_s = size / PCM_BYTES_PER_SAMPLE / sample_rate
    first = total if first is None else first
    return {"first_byte_s": first, "total_s": total, "audio_s": audio_s, "fraction": first / total}


async def ours_run(
    url: str, workload: Workload, rates: tuple[float, ...], openai_text: str, bench: BenchmarkRun
) -> dict[str, Any]:
    """The Ray Serve app's parts, each written into `bench`'s report as it ends."""
    with bench.phase("closed_loops"):
        closed = await run_sweep(url, workload, bench, report_key="ray_serve")
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=workload.timeout_s, limits=limits) as client:
        info = (await client.get("/v1/voices")).json()
        model_name = (await client.get("/v1/models")).json()["data"][0]["id"]
        sample_rate = int(info["sample_rate"])
        poisson: list[LevelResult] = []
        with bench.phase("poisson"):
            for rate in rates:
                level = poisson_level(client, workload, rate, sample_rate, bench)
                measured = await bench.within_budget(level, f"poisson {rate:g}/s")
                if measured is not None:
                    poisson.append(measured)
                    bench.record(ray_serve=[level_dict(r) for r in closed + poisson])
        with bench.phase("late_arrival"):
            late = await late_arrival(client, workload, sample_rate, bench)
        bench.record(late_arrival=late)
        with bench.phase("openai"):
            openai = await openai_first_byte(
                client, model_name, info["voices"][0], openai_text, workload.repeats, bench
            )
        bench.record(openai_20s=openai)
    return {"closed": closed, "poisson": poisson, "late_arrival": late, "openai": openai}


def level(results: list[LevelResult], mode: str, concurrency: int) -> LevelResult | None:
    """The level of `mode` at `concurrency`; None where the time budget left it out."""
    return next((r for r in results if r.mode == mode and r.concurrency == concurrency), None)


def unmeasured(*names: str) -> dict[str, None]:
    """Figures whose parts did not run (the time budget): each key and its spread null."""
    return {key: None for name in names for key in (name, f"{name}_spread")}


def batching_figures(
    top: LevelResult,
    c1: LevelResult,
    baseline_top: LevelResult,
    engine_ratio: Timing | None,
    compared: int,
    failed: FailedMeasurements,
) -> dict[str, Any]:
    """Whole-request throughput at the compared level against the baseline's and against ours at 1 client, and
    the batching efficiency (that serving ratio / the engine's `engine_ratio`, None where it failed its bound):
    ratios taken repeat by repeat, reported as median and spread. A serving ratio outside [0, compared] is a
    failed measurement, and so is an efficiency above what a serving ratio within that bound allows; the
    efficiency of a failed ratio is null."""
    assert top.throughput and c1.throughput and baseline_top.throughput  # every summarized level has them
    against_baseline = paired(ratio, top.throughput, baseline_top.throughput)
    serving = paired(ratio, top.throughput, c1.throughput)
    fields = {
        **failed.bounded_fields(
            f"throughput_ratio_c{compared}",
            against_baseline,
            0.0,
            math.inf,
            "a throughput ratio is finite and not negative (none: the baseline delivered no audio)",
        ),
        **failed.bounded_fields(
            f"serving_throughput_ratio_c{compared}_vs_c1",
            serving,
            0.0,
            float(compared),
            f"{compared} clients cannot get more than {compared} times the throughput of 1 client, nor less than 0",
        ),
    }
    efficiency_key = f"batching_efficiency_c{compared}"
    if engine_ratio is None or fields[f"serving_throughput_ratio_c{compared}_vs_c1"] is None:
        return {**fields, efficiency_key: None, f"{efficiency_key}_spread": None}
    efficiency = paired(ratio, serving, engine_ratio)
    why = f"the serving ratio is at most {compared}, so the efficiency is at most {compared} / the engine's ratio"
    return {**fields, **failed.bounded_fields(efficiency_key, efficiency, 0.0, compared / engine_ratio.median, why)}


def app_args_for(compared: int, num_gpus: float) -> dict[str, Any]:
    # The loop may hold every request of the compared level; on a GPU the replica gets `num_gpus` of it.
    return {"decoder": {"max_batch_size": compared, "batch_wait_timeout_s": 0.02, "num_gpus": num_gpus}}


def load_in_process(model: str, device: str) -> Any:
    from engine.runtime.pipeline import CosyVoice

    torch.set_num_threads(BASELINE_THREADS)
    return CosyVoice.load(model, device=device, dtype=dtype_for(device))


def baseline_workload(workload: Workload, compared: int) -> Workload:
    """The baseline serves one request at a time: only whole requests at 1 client and at the compared level (its
    other levels take as long and add nothing)."""
    return replace(workload, modes=("whole",), concurrencies=(1, compared))


def compare_steps(workload: Workload, rates: tuple[float, ...]) -> int:
    """The progress steps of a whole comparison: the engine's two batch sizes, each request of the closed loops and
    Poisson levels, each probe, each overhead pair and each baseline request."""
    compared = max(workload.concurrencies)
    poisson = len(rates) * workload.repeats * workload.requests_per_level
    probes = 2 * workload.repeats  # the late-arrival probe and the OpenAI request
    overhead = workload.warmup + workload.repeats * workload.requests_per_level
    baseline = sweep_steps(baseline_workload(workload, compared))
    return 2 + sweep_steps(workload) + poisson + probes + overhead + baseline


def setup_fields(model: str, device: str, workload: Workload, rates: tuple[float, ...], app_args: dict) -> dict:
    return {
        "model": model,
        "device": device,
        "profile": {
            "requests": workload.requests_per_level,
            "poisson_rates_per_s": list(rates),
            "repeats": workload.repeats,
            "warmup": workload.warmup,
        },
        "workload": asdict(workload),
        "ray_app_args": app_args,
        "baseline_and_in_process_torch_threads": BASELINE_THREADS,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }


def compare(
    model: str,
    workload: Workload,
    rates: tuple[float, ...],
    bench: BenchmarkRun,
    device: str = "cpu",
    num_gpus: float = 0.0,
) -> dict[str, Any]:
    """The whole comparison; the compared level is the largest client count (8 by default: the `_c8` keys). Each
    part goes into `bench`'s report as it ends; the parts the time budget leaves no time for are left out, and
    the figures that need them are null."""
    compared = max(workload.concurrencies)
    app_args = app_args_for(compared, num_gpus)
    bench.plan(compare_steps(workload, rates))
    bench.record(setup=setup_fields(model, device, workload, rates, app_args))
    tts = load_in_process(model, device)
    failed = FailedMeasurements()
    # In-process first, with nothing else running; then each server alone on the machine.
    with bench.phase("engine"):
        engine, engine_ratio = in_process(tts, compared, workload, failed, bench)
    bench.record(engine=engine)
    # The OpenAI endpoint takes no sampling options: the text is sized for the model's default longest speech
    # (random weights rarely stop earlier); the audio it gave is recorded.
    openai_text = text_for_audio_seconds(tts, OPENAI_AUDIO_S, SamplingOptions().max_token_text_ratio)
    ours: dict[str, Any] = {"closed": [], "poisson": [], "late_arrival": None, "openai": None}
    overhead, replica_stats = None, None
    # A server is not started when the budget leaves no time to measure anything on it.
    if not bench.out_of_time("ray serve"):
        with local_server(model, app_args) as url:
            ours = asyncio.run(ours_run(url, workload, rates, openai_text, bench))
            with bench.phase("overhead"):
                overhead = interleaved_overhead(url, tts, workload, bench)
            bench.record(overhead_c1=overhead)
            replica_stats = serve.get_deployment_handle("Decoder", BENCH_APP).batch_stats.remote().result()
    del tts
    baseline: list[LevelResult] = []
    if not bench.out_of_time("baseline"):
        with bench.phase("baseline"), baseline_server(model, device) as url:
            sweep = run_sweep(url, baseline_workload(workload, compared), bench, report_key="baseline")
            baseline = asyncio.run(sweep)
    closed = ours["closed"]
    for name, results in (("ray serve", closed + ours["poisson"]), ("baseline", baseline)):
        print(name)
        print_table(results)

    c1, top = level(closed, "whole", 1), level(closed, "whole", compared)
    baseline_top = level(baseline, "whole", compared)
    if c1 is None or top is None or baseline_top is None:
        names = (f"throughput_ratio_c{compared}", f"serving_throughput_ratio_c{compared}_vs_c1")
        figures = unmeasured(*names, f"batching_efficiency_c{compared}")
    else:
        figures = batching_figures(top, c1, baseline_top, engine_ratio, compared, failed)
    ttfa_levels = {f"stream_c{r.concurrency}": r for r in closed if r.mode == "stream"}
    ttfa_levels |= {r.mode: r for r in ours["poisson"]}
    late, openai = ours["late_arrival"], ours["openai"]
    return {
        **figures,
        "p50_ttfa_s": {name: r.first_chunk_s.get("p50") for name, r in ttfa_levels.items()},
        "p95_ttfa_s": {name: r.first_chunk_s.get("p95") for name, r in ttfa_levels.items()},
        **rename(late, "ratio", "late_arrival_ttfa_ratio"),
        **rename(overhead, "ms", "overhead_ms_c1"),
        **rename(openai, "fraction", "openai_first_byte_fraction_20s"),
        "failed_measurements": failed.entries,
        "engine": engine,
        "overhead_c1": overhead,
        "late_arrival": late,
        "openai_20s": openai,
        "decoder_replica": replica_stats,  # the loop's batch statistics and the replica's peak device memory
        "errors": {
            "ray_serve": sum(r.errors for r in closed + ours["poisson"]),
            "baseline": sum(r.errors for r in baseline),
        },
        "ray_serve": [level_dict(r) for r in closed + ours["poisson"]],
        "baseline": [level_dict(r) for r in baseline],
    }


def rename(part: dict[str, Any] | None, key: str, name: str) -> dict[str, Any]:
    """`part[key]` and its spread as the headline figure `name` (null where the part did not run)."""
    if part is None:
        return unmeasured(name)
    return {name: part[key], f"{name}_spread": part[f"{key}_spread"]}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(report["p50_ttfa_s"])
    for key, offset in (("p50_ttfa_s", -0.2), ("p95_ttfa_s", 0.2)):
        values = [report[key][name] or 0.0 for name in names]
        left.bar([i + offset for i in range(len(names))], values, width=0.4, label=key.split("_")[0])
    left.set_xticks(range(len(names)), names, rotation=30)
    left.set(ylabel="seconds", title="Time to first audio (streaming)")
    left.legend()
    for name, rows in (("ray serve", report["ray_serve"]), ("baseline", report["baseline"])):
        whole = [r for r in rows if r["mode"] == "whole"]
        right.plot([r["concurrency"] for r in whole], [r["audio_s_per_s"] for r in whole], "-o", label=name)
    right.set(xlabel="concurrent clients (whole requests)", ylabel="audio seconds / second", title="Throughput")
    right.legend()
    efficiency = next(v for k, v in report.items() if k.startswith("batching_efficiency_c"))
    figure.suptitle(f"{report['setup']['model']} on {report['setup']['device']}: batching efficiency {efficiency}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def headline(report: dict[str, Any]) -> dict[str, Any]:
    prefixes = ("throughput_ratio_c", "batching_efficiency_c", "p50_ttfa", "p95_ttfa", "late_arrival", "overhead_ms")
    keys = [k for k in report if k.startswith(prefixes)]
    keys += ["openai_first_byte_fraction_20s", "openai_first_byte_fraction_20s_spread", "errors", "failed_measurements"]
    keys += ["complete", "stopped", "phase_s", "run_s"]
    return {key: report[key] for key in keys if key in report}


def overhead_only(
    model: str, workload: Workload, device: str, num_gpus: float, bench: BenchmarkRun, streams: bool = False
) -> dict[str, Any]:
    """Only `overhead_ms_c1`: the interleaved measure on a local Serve configured as in the full comparison; with
    `streams` (`--hops-only`) also, on the same server, `stream_first_byte_s_c1` and `stream_bytes_per_s_c<N>` of
    the largest client count."""
    compared = max(workload.concurrencies)
    app_args = app_args_for(compared, num_gpus)
    stream_workload = replace(workload, modes=("stream",), concurrencies=(1, compared), warmup=0)
    streams_steps = sweep_steps(stream_workload) if streams else 0
    bench.plan(workload.warmup + workload.repeats * workload.requests_per_level + streams_steps)
    setup = {
        "model": model,
        "device": device,
        "requests": workload.requests_per_level,
        "repeats": workload.repeats,
        "warmup": workload.warmup,
        "ray_app_args": app_args,
    }
    bench.record(setup=setup)
    tts = load_in_process(model, device)
    stream_levels: list[LevelResult] = []
    with local_server(model, app_args) as url:
        with bench.phase("overhead"):
            overhead = interleaved_overhead(url, tts, workload, bench)
        if streams and not bench.out_of_time("streams"):
            with bench.phase("streams"):  # the overhead's pairs were its warm-up
                stream_levels = asyncio.run(run_sweep(url, stream_workload, bench, report_key="streams"))
        # what this local Ray's replicas were started with: a Serve mode that did not reach them shows here
        replica_env = replica_serve_env(os.getpid())
    report = {**rename(overhead, "ms", "overhead_ms_c1"), "overhead_c1": overhead, "replica_env": replica_env}
    if streams:
        report |= stream_figures(stream_levels, compared, tts.sample_rate)
    return report


def replica_serve_env(root: int) -> list[dict[str, object]]:
    """Each Serve replica process under `root` with the `RAY_SERVE_*` environment it was started with (from /proc):
    `{"replica": its process title (ray::ServeReplica:<app>:<deployment>), "pid", "env"}`."""
    found: list[dict[str, object]] = []
    for pid in sorted(process_tree(root)):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            title = process_title(pid)
            if title.startswith(REPLICA_TITLE):
                entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                pairs = (entry.decode(errors="replace").partition("=") for entry in entries if entry)
                env = {key: value for key, _, value in pairs if key.startswith("RAY_SERVE_")}
                found.append({"replica": title, "pid": pid, "env": env})
    return found


def stream_figures(levels: list[LevelResult], compared: int, sample_rate: int) -> dict[str, Any]:
    """The first audio byte of a stream at 1 client (p50 of every repeat's requests) and the bytes per second of
    `compared` concurrent streams (16-bit PCM; median of the repeats, with its spread); null where the time budget
    left a level out."""
    c1, top = level(levels, "stream", 1), level(levels, "stream", compared)
    first_byte = c1.first_chunk_s.get("p50") if c1 is not None else None
    figures: dict[str, Any] = {"stream_first_byte_s_c1": first_byte}
    bytes_key = f"stream_bytes_per_s_c{compared}"
    if top is None or top.throughput is None:
        return figures | unmeasured(bytes_key)
    bytes_per_s = top.throughput.map(lambda audio_s_per_s: audio_s_per_s * sample_rate * PCM_BYTES_PER_SAMPLE)
    return figures | bytes_per_s.fields(bytes_key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="tiny", help="tiny (default, minutes on a CPU) or dummy (real size)")
    parser.add_argument("--requests", type=int, help="requests per level and Poisson rate (default: the profile's)")
    parser.add_argument("--rates", type=float, nargs="+", help="Poisson arrivals per second (default: the profile's)")
    parser.add_argument("--overhead-only", action="store_true", help="only the interleaved overhead measure")
    hops_help = (
        "the overhead measure, then a stream's first byte at 1 client and the bytes/s of the most clients' streams"
    )
    parser.add_argument("--hops-only", action="store_true", help=hops_help)
    dry_help = "check the arguments and write the workload as JSON; start nothing (gpu_check.sh --quick)"
    parser.add_argument("--dry-run", action="store_true", help=dry_help)
    levels_help = "closed-loop client counts; the largest is the compared level"
    parser.add_argument("--clients", type=int, nargs="+", default=list(CLOSED_LOOP_CLIENTS), help=levels_help)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="in-process and baseline device")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPU fraction of the Serve decoder replica")
    add_repeat_options(parser)
    add_budget_option(parser, BUDGET_MINUTES)
    options = parser.parse_args()
    if 1 not in options.clients:
        parser.error("--clients must include 1 (the baseline of the batching efficiency)")
    if (options.device == "cuda") != (options.num_gpus > 0):
        parser.error("--device cuda goes with --num-gpus > 0 (and cpu with 0)")
    clients = tuple(sorted(set(options.clients)))
    profile = PROFILES.get(options.model, PROFILES["dummy"])  # a model directory is real size
    profile = replace(
        profile, requests=options.requests or profile.requests, rates=tuple(options.rates or profile.rates)
    )
    workload = profile.workload(clients, options.repeats, options.warmup)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    if options.dry_run:
        plan = {"dry_run": True, "model": options.model, "num_gpus": options.num_gpus, "workload": asdict(workload)}
        options.out.write_text(json.dumps(plan, indent=2, default=str))
        print(json.dumps(plan, default=str))
        return
    bench = BenchmarkRun("compare", options.out, options.budget_minutes)
    if options.overhead_only or options.hops_only:
        measured = overhead_only(options.model, workload, options.device, options.num_gpus, bench, options.hops_only)
        report = bench.finish(measured)
        keys = ["overhead_ms_c1", "overhead_c1", "complete"]
        keys += [key for key in report if key.startswith(("stream_first_byte", "stream_bytes"))]
        print(json.dumps({key: report[key] for key in keys}, indent=2))
        return
    report = bench.finish(compare(options.model, workload, profile.rates, bench, options.device, options.num_gpus))
    plot(report, options.out.with_suffix(".png"))
    print(json.dumps(headline(report), indent=2))
    for entry in report["failed_measurements"]:
        print(f"failed measurement: {entry['name']} = {entry['value']} ({entry['why']})")


if __name__ == "__main__":
    main()
