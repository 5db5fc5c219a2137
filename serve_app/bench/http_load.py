"""HTTP load benchmark of the `/v1/tts` API: a concurrency sweep, streaming and whole, mixed text lengths.

For each mode and concurrency it sends a fixed number of requests (`requests_per_level`) from that many
concurrent clients, `repeats` times (after `warmup` untimed requests), and reports p50/p95/p99 time to the first
audio byte and latency over every repeat's requests, the real-time factor (latency / audio seconds), throughput
(requests and audio seconds per wall second: the median of the repeats, with `<name>_spread`) and errors.
Writes `<out>/bench.json`, `<out>/latency_vs_concurrency.png` and `<out>/throughput_vs_concurrency.png`.

    cosyvoice-serve bench [--url http://127.0.0.1:8000] [--concurrency 1 2 4 8 16] [--out out/bench]

Without `--url` it starts the local tiny app (a local Ray) for the run and stops it afterwards.

The default run (`cosyvoice-serve bench`, the local tiny app) takes about 2 minutes on the 2-core machine (109 s,
Intel Xeon with AMX, 2026-12-07).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from serve_app.bench.progress import BenchmarkRun
from serve_app.bench.timing import DEFAULT_REPEATS, DEFAULT_WARMUP, Timing

MODES = ("whole", "stream")
# Short, medium and long inputs (1, 2 and 4 sentences), cycled through the requests of each level.
TEXTS = (
    "Hello there.",
    "The weather is nice today. Let us take a walk in the park.",
    "Streaming speech starts playing before the whole text is done. "
    "That is what the first chunk measures. "
    "Batching lets several requests share the accelerator. "
    "Throughput is audio seconds produced per second.",
)
PCM_BYTES_PER_SAMPLE = 2  # the workload asks for 16-bit mono PCM
BENCH_APP = "cosyvoice-bench"  # the Serve application name of `local_server`


@dataclass(frozen=True)
class Workload:
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16)
    modes: tuple[str, ...] = MODES
    requests_per_level: int = 16
    texts: tuple[str, ...] = TEXTS
    # Dummy and tiny weights rarely emit end-of-speech: cap the speech tokens per text token (None: model default).
    max_token_text_ratio: float | None = 3.0
    timeout_s: float = 300.0
    repeats: int = DEFAULT_REPEATS  # runs of each level: its throughput is their median, its percentiles pooled
    warmup: int = DEFAULT_WARMUP  # untimed requests before the sweep

    def body(self, index: int, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "text": self.texts[index % len(self.texts)],
            "format": "pcm",
            "stream": stream,
            "seed": index,
        }
        if self.max_token_text_ratio is not None:
            body["sampling"] = {"max_token_text_ratio": self.max_token_text_ratio}
        return body


@dataclass
class Sample:
    ok: bool
    first_chunk_s: float = 0.0
    latency_s: float = 0.0
    audio_s: float = 0.0
    error: str = ""


@dataclass
class LevelResult:
    """One level of load over its repeats: the per-request percentiles pool every repeat's requests; the wall time
    and throughputs are the median of the repeats, with `<name>_spread` ({min, max, n}) beside each."""

    mode: str
    concurrency: int
    requests: int  # sent per repeat
    errors: int  # over all repeats
    wall_s: float
    first_chunk_s: dict[str, float] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    real_time_factor: dict[str, float] = field(default_factory=dict)
    requests_per_s: float = 0.0
    audio_s_per_s: float = 0.0
    error_examples: list[str] = field(default_factory=list)
    repeats: int = 1
    wall_s_spread: dict[str, float] = field(default_factory=dict)
    requests_per_s_spread: dict[str, float] = field(default_factory=dict)
    audio_s_per_s_spread: dict[str, float] = field(default_factory=dict)
    # each repeat's throughputs, for ratios taken repeat by repeat (`serve_app.bench.timing.paired`); not in the JSON
    throughput: Timing | None = field(default=None, repr=False, compare=False)


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    p50, p95, p99 = np.percentile(np.asarray(values, dtype=float), [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "mean": float(np.mean(values))}


@dataclass(frozen=True)
class LevelRun:
    """One repeat of a level: its requests and the wall seconds they took together."""

    samples: list[Sample]
    wall_s: float

    def rate(self, value: Callable[[Sample], float]) -> float:
        """The sum of `value` over the good requests per wall second."""
        return sum(value(s) for s in self.samples if s.ok) / self.wall_s if self.wall_s > 0 else 0.0


def summarize(mode: str, concurrency: int, runs: list[LevelRun]) -> LevelResult:
    samples = [s for run in runs for s in run.samples]
    good = [s for s in samples if s.ok]
    wall = Timing(tuple(run.wall_s for run in runs))
    requests_per_s = Timing(tuple(run.rate(lambda s: 1.0) for run in runs))
    audio_s_per_s = Timing(tuple(run.rate(lambda s: s.audio_s) for run in runs))
    return LevelResult(
        mode=mode,
        concurrency=concurrency,
        requests=len(runs[0].samples),
        errors=len(samples) - len(good),
        wall_s=wall.median,
        first_chunk_s=percentiles([s.first_chunk_s for s in good]),
        latency_s=percentiles([s.latency_s for s in good]),
        real_time_factor=percentiles([s.latency_s / s.audio_s for s in good if s.audio_s > 0]),
        requests_per_s=requests_per_s.median,
        audio_s_per_s=audio_s_per_s.median,
        error_examples=sorted({s.error for s in samples if not s.ok})[:5],
        repeats=len(runs),
        wall_s_spread=wall.spread(),
        requests_per_s_spread=requests_per_s.spread(),
        audio_s_per_s_spread=audio_s_per_s.spread(),
        throughput=audio_s_per_s,
    )


def level_dict(result: LevelResult) -> dict[str, Any]:
    """A level for the JSON (its per-repeat Timing left out: the spread fields carry it)."""
    return {k: v for k, v in asdict(result).items() if k != "throughput"}


async def one_request(client: httpx.AsyncClient, body: dict[str, Any], sample_rate: int) -> Sample:
    started = time.perf_counter()
    first_chunk_s, size = None, 0
    try:
        async with client.stream("POST", "/v1/tts", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Sample(ok=False, error=f"{response.status_code}: {response.text[:200]}")
            async for piece in response.aiter_bytes():
                if piece and first_chunk_s is None:
                    first_chunk_s = time.perf_counter() - started
                size += len(piece)
    except httpx.HTTPError as exc:
        return Sample(ok=False, error=f"{type(exc).__name__}: {exc}")
    latency_s = time.perf_counter() - started
    audio_s = size / PCM_BYTES_PER_SAMPLE / sample_rate
    return Sample(ok=size > 0, first_chunk_s=first_chunk_s or latency_s, latency_s=latency_s, audio_s=audio_s)


async def run_level(
    client: httpx.AsyncClient, workload: Workload, mode: str, concurrency: int, sample_rate: int, bench: BenchmarkRun
) -> LevelResult:
    """`workload.repeats` times: `requests_per_level` requests from `concurrency` clients that each send the next
    one when theirs ends."""

    async def once() -> LevelRun:
        indices = iter(range(workload.requests_per_level))
        samples: list[Sample] = []

        async def client_loop() -> None:
            for index in indices:  # a shared iterator: each index goes to exactly one client
                samples.append(await one_request(client, workload.body(index, mode == "stream"), sample_rate))
                bench.step(f"{mode} c={concurrency}")

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return LevelRun(samples, time.perf_counter() - started)

    return summarize(mode, concurrency, [await once() for _ in range(workload.repeats)])


def sweep_steps(workload: Workload) -> int:
    """The requests of a sweep (its progress steps), the warm-up left out."""
    return len(workload.modes) * len(workload.concurrencies) * workload.repeats * workload.requests_per_level


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header of a server with API keys; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def run_sweep(
    url: str, workload: Workload, bench: BenchmarkRun, api_key: str | None = None, report_key: str = "results"
) -> list[LevelResult]:
    """Every mode at every concurrency, each level written into `bench`'s report under `report_key` as it ends; a
    level the time budget does not leave time for is cut and left out (`BenchmarkRun.within_budget`)."""
    limits = httpx.Limits(max_connections=max(workload.concurrencies) + 4)
    headers = auth_headers(api_key)
    async with httpx.AsyncClient(base_url=url, timeout=workload.timeout_s, limits=limits, headers=headers) as client:
        voices = await client.get("/v1/voices")
        voices.raise_for_status()
        sample_rate = int(voices.json()["sample_rate"])
        for index in range(workload.warmup):  # first-call costs stay out of the figures
            await one_request(client, workload.body(index, False), sample_rate)
        results: list[LevelResult] = []
        for mode in workload.modes:
            for concurrency in workload.concurrencies:
                level = run_level(client, workload, mode, concurrency, sample_rate, bench)
                result = await bench.within_budget(level, f"{report_key} {mode} c={concurrency}")
                if result is not None:
                    results.append(result)
                    bench.record(**{report_key: [level_dict(r) for r in results]})
        return results


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_answering(url: str, process: subprocess.Popen[bytes], what: str, timeout_s: float) -> None:
    """Poll GET `url` until it answers 200; RuntimeError naming `what` if `process` exits first or `timeout_s` pass."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before it answered")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} within {timeout_s:g} s")
        time.sleep(0.5)


@contextmanager
def local_server(model: str = "tiny", app_args: dict[str, Any] | None = None) -> Iterator[str]:
    """Start a local Ray and the app on a free 127.0.0.1 port; yield its URL; shut both down after.

    Its workers run at the benchmark's own priority: Ray nices them to 15 by default, which on a machine shared
    with other work slows the replicas against any in-process or baseline run they are compared with."""
    import ray
    from ray import serve

    from serve_app.ingress import build_app

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local single-user cluster
    os.environ.setdefault("RAY_worker_niceness", "0")
    # address="local": a Ray of our own. A bare ray.init() joins a cluster another process started on this machine,
    # and the shutdown below would then stop that cluster's Serve applications.
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"model": model, **(app_args or {})}), name=BENCH_APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def plot(results: list[LevelResult], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    paths = []
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for mode in sorted({r.mode for r in results}):
        rows = [r for r in results if r.mode == mode and r.latency_s]
        levels = [r.concurrency for r in rows]
        for key, style in (("p50", "-o"), ("p95", "--o")):
            axis.plot(levels, [r.latency_s[key] for r in rows], style, label=f"{mode} latency {key}")
        if mode == "stream":
            axis.plot(levels, [r.first_chunk_s["p50"] for r in rows], ":s", label="stream first chunk p50")
    axis.set(xscale="log", xlabel="concurrent clients", ylabel="seconds", title="Latency vs concurrency")
    axis.legend()
    paths.append(out_dir / "latency_vs_concurrency.png")
    figure.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for mode in sorted({r.mode for r in results}):
        rows = [r for r in results if r.mode == mode]
        axis.plot([r.concurrency for r in rows], [r.audio_s_per_s for r in rows], "-o", label=mode)
    axis.set(xscale="log", xlabel="concurrent clients", ylabel="audio seconds / second", title="Throughput")
    axis.legend()
    paths.append(out_dir / "throughput_vs_concurrency.png")
    figure.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(figure)
    return paths


def write_report(
    url: str, workload: Workload, results: list[LevelResult], out_dir: Path, bench: BenchmarkRun
) -> dict[str, Any]:
    """The finished report in `<out_dir>/bench.json` (`bench`'s file), and the plots beside it (their paths under
    "plots" in the returned report, not in the file)."""
    report = bench.finish({"url": url, "workload": asdict(workload), "results": [level_dict(r) for r in results]})
    return {**report, "plots": [str(path) for path in plot(results, out_dir)]}


def print_table(results: list[LevelResult]) -> None:
    print(
        f"{'mode':<7}{'c':>4}{'ok':>5}{'err':>5}{'ttfc p50':>10}{'p95':>8}{'lat p50':>9}{'p95':>8}{'p99':>8}"
        f"{'RTF p50':>9}{'audio s/s':>11}"
    )
    for r in results:
        ttfc, latency, rtf = r.first_chunk_s or {}, r.latency_s or {}, r.real_time_factor or {}
        print(
            f"{r.mode:<7}{r.concurrency:>4}{r.requests - r.errors:>5}{r.errors:>5}"
            f"{ttfc.get('p50', float('nan')):>10.3f}{ttfc.get('p95', float('nan')):>8.3f}"
            f"{latency.get('p50', float('nan')):>9.3f}{latency.get('p95', float('nan')):>8.3f}"
            f"{latency.get('p99', float('nan')):>8.3f}{rtf.get('p50', float('nan')):>9.3f}{r.audio_s_per_s:>11.2f}"
        )


def bench(
    url: str | None, workload: Workload, out_dir: Path, model: str = "tiny", api_key: str | None = None
) -> dict[str, Any]:
    """Run the sweep against `url` (with `api_key` where it has API keys), or against a local app started for the
    run when `url` is None; `<out_dir>/bench.json` is written as each level ends (`serve_app.bench.progress`)."""
    if url is None:
        with local_server(model) as local_url:
            return bench(local_url, workload, out_dir)
    run = BenchmarkRun("bench", out_dir / "bench.json")
    run.plan(sweep_steps(workload))
    run.record(url=url, workload=asdict(workload))
    results = asyncio.run(run_sweep(url, workload, run, api_key))
    print_table(results)
    return write_report(url, workload, results, out_dir, run)
