"""Soak test: fixed concurrency against a local app for N minutes; every request must be answered.

Starts a local Ray and the app (tiny model by default) on 127.0.0.1, keeps `--concurrency` requests in flight
for `--minutes`, then reports requests sent and answered (an HTTP status came back), statuses, latency, and the
resident memory of each Serve replica process: first and last sample and the growth per 1000 requests (the
least-squares slope of RSS against requests answered so far, sampled every `--sample-s`).

    python -m benchmarks.soak --minutes 2 [--concurrency 4] [--model tiny] [--out out/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import ray

from serve_app.bench.http_load import free_port
from serve_app.bench.progress import BenchmarkRun

# psutil is not a dependency of this project; Ray bundles it and `import ray` puts it on sys.path.
psutil = importlib.import_module("psutil")

APP_NAME = "soak"
REPLICA_TITLE = "ServeReplica:"  # Ray's process title for a Serve replica: ray::ServeReplica:<app>:<deployment>
TEXTS = ("Hello there.", "The weather is fine today.", "One more short sentence, please.")


def replica_rss_mb(app_name: str) -> dict[str, float]:
    """RSS in MiB of each replica process of `app_name` on this machine, keyed "<deployment> (pid N)"."""
    prefix = f"{REPLICA_TITLE}{app_name}:"  # other Ray instances on the machine have other app names
    sizes = {}
    for process in psutil.process_iter(["pid", "cmdline", "memory_info"]):
        title = " ".join(process.info["cmdline"] or [])
        if prefix not in title or process.info["memory_info"] is None:
            continue
        deployment = title.split(prefix, 1)[1].split()[0].split(".")[0]  # the title may end in ".<method>"
        sizes[f"{deployment} (pid {process.info['pid']})"] = process.info["memory_info"].rss / 2**20
    return sizes


def slope_per_1000(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of MiB against requests, times 1000; None with fewer than two distinct counts."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return None
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    variance = sum((x - mean_x) ** 2 for x in xs)
    return 1000 * covariance / variance


class Tally:
    def __init__(self) -> None:
        self.sent = 0
        self.answered = 0
        self.statuses: Counter[int] = Counter()
        self.transport_errors: Counter[str] = Counter()
        self.latencies_s: list[float] = []


async def worker(client: httpx.AsyncClient, index: int, deadline: float, tally: Tally, voice: str) -> None:
    count = 0
    while time.monotonic() < deadline:
        body = {
            "text": TEXTS[(index + count) % len(TEXTS)],
            "voice": voice,
            "seed": count,
            "sampling": {"max_token_text_ratio": 3.0},  # dummy weights rarely stop: bound the speech length
        }
        count += 1
        tally.sent += 1
        start = time.monotonic()
        try:
            response = await client.post("/v1/tts", json=body)
        except httpx.HTTPError as exc:
            tally.transport_errors[type(exc).__name__] += 1
            continue
        tally.answered += 1
        tally.statuses[response.status_code] += 1
        tally.latencies_s.append(time.monotonic() - start)


async def soak(
    url: str, minutes: float, concurrency: int, sample_s: float, timeout_s: float, bench: BenchmarkRun
) -> dict[str, Any]:
    """The soak; at each memory sample its figures so far go into `bench`'s report (a progress step)."""
    tally = Tally()
    bench.plan(math.ceil(60 * minutes / sample_s))
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        voice = (await client.get("/v1/voices")).json()["voices"][0]
        for text in TEXTS:  # warm-up: first-call allocations are not growth
            (await client.post("/v1/tts", json={"text": text, "voice": voice, "seed": 0})).raise_for_status()
        samples: list[tuple[int, dict[str, float]]] = [(0, replica_rss_mb(APP_NAME))]
        deadline = time.monotonic() + 60 * minutes
        started = time.monotonic()
        workers = [asyncio.create_task(worker(client, i, deadline, tally, voice)) for i in range(concurrency)]
        while not all(task.done() for task in workers):
            await asyncio.wait(workers, timeout=sample_s)
            samples.append((tally.answered, replica_rss_mb(APP_NAME)))
            report = soak_report(minutes, concurrency, tally, samples, time.monotonic() - started)
            bench.step(f"{tally.answered} answered", **report)
        for task in workers:
            task.result()  # a bug in the loop itself must not pass for a clean run
    return soak_report(minutes, concurrency, tally, samples, time.monotonic() - started)


def soak_report(
    minutes: float, concurrency: int, tally: Tally, samples: list[tuple[int, dict[str, float]]], elapsed: float
) -> dict[str, Any]:
    """The figures of the soak so far: `samples` are (requests answered, each replica's RSS in MiB)."""
    replicas = sorted(samples[0][1])
    memory = {
        name: {
            "first_mb": round(samples[0][1][name], 1),
            "last_mb": round(samples[-1][1].get(name, float("nan")), 1),
            "growth_mb_per_1000_requests": slope_per_1000([(n, rss[name]) for n, rss in samples if name in rss]),
        }
        for name in replicas
    }
    latencies = sorted(tally.latencies_s)
    return {
        "minutes": minutes,
        "concurrency": concurrency,
        "sent": tally.sent,
        "answered": tally.answered,
        "all_answered": tally.sent == tally.answered,
        "statuses": {str(code): count for code, count in sorted(tally.statuses.items())},
        "transport_errors": dict(tally.transport_errors),
        "requests_per_s": tally.answered / elapsed,
        "latency_p50_s": latencies[len(latencies) // 2] if latencies else None,
        "latency_p95_s": latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
        "memory_samples": len(samples),
        "replica_memory": memory,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--model", default="tiny", help="model dir or preset for the local app")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per-request timeout")
    parser.add_argument("--out", type=Path, default=Path("out/soak.json"))
    options = parser.parse_args(argv)

    from ray import serve

    from serve_app import build_app

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"model": options.model}), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        bench = BenchmarkRun("soak", options.out)
        figures = soak(url, options.minutes, options.concurrency, options.sample_s, options.timeout_s, bench)
        result = bench.finish(asyncio.run(figures))
    finally:
        serve.shutdown()
        ray.shutdown()
    print(json.dumps(result, indent=2))
    return 0 if result["all_answered"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
