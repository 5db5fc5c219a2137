"""Side-by-side: this Ray Serve app against a baseline built like the official CosyVoice server, one run.

The same `benchmarks.http_bench` workload (whole and streaming, mixed text lengths, concurrency 1 and 8)
goes to (a) the Ray Serve app and (b) `benchmarks.baseline_server` (one model copy, one request at a
time), both on 127.0.0.1 with the same engine and weights; then the Ray Serve overhead at concurrency 1
against calling `CosyVoice.synthesize` in-process on the same texts. Headline keys:

- `throughput_ratio_c8`: audio seconds per second, ours / baseline, whole requests at concurrency 8;
- `p50_first_chunk_ratio_c8`: p50 time to the first audio byte, ours / baseline, streaming, concurrency 8;
- `overhead_ratio_c1`: p50 latency of whole requests through Ray Serve at concurrency 1 / in-process p50.

    python -m benchmarks.compare --out out/compare.json [--model tiny|dummy] [--requests 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.http_bench import LevelResult, Workload, free_port, local_server, percentiles, print_table, run_sweep

COMPARED_CONCURRENCY = 8
# Batches can take every request of the compared level.
RAY_APP_ARGS = {"decoder": {"max_batch_size": COMPARED_CONCURRENCY, "batch_wait_timeout_s": 0.02}}
BASELINE_THREADS = 1  # torch threads of the baseline and in-process runs: Ray gives a replica's torch 1


@contextmanager
def baseline_server(model: str, ready_timeout_s: float = 300.0) -> Iterator[str]:
    """Start `benchmarks.baseline_server` in a subprocess; yield its URL once it answers; stop it after."""
    port = free_port()
    command = [sys.executable, "-m", "benchmarks.baseline_server", "--model", model, "--port", str(port)]
    process = subprocess.Popen([*command, "--threads", str(BASELINE_THREADS)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the baseline server exited with {process.returncode}")
            try:
                if httpx.get(f"{url}/v1/voices", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the baseline server did not start")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def in_process_latencies(model: str, workload: Workload) -> list[float]:
    """Sequential `CosyVoice.synthesize` latencies of the workload's whole requests (after one warm-up)."""
    from engine.pipeline import CosyVoice

    torch.set_num_threads(BASELINE_THREADS)
    tts = CosyVoice.load(model)
    voice = tts.voices[0]

    def synthesize(index: int) -> float:
        body = workload.body(index, stream=False)
        started = time.perf_counter()
        tts.synthesize(body["text"], voice, seed=body["seed"], **body.get("sampling", {}))
        return time.perf_counter() - started

    synthesize(0)
    return [synthesize(index) for index in range(workload.requests_per_level)]


def level(results: list[LevelResult], mode: str, concurrency: int) -> LevelResult:
    return next(r for r in results if r.mode == mode and r.concurrency == concurrency)


def ratio(ours: float, theirs: float) -> float | None:
    return ours / theirs if theirs else None


def compare(model: str, workload: Workload) -> dict[str, Any]:
    # In-process first, with nothing else running; then each server alone on the machine.
    in_process = percentiles(in_process_latencies(model, workload))
    with local_server(model, RAY_APP_ARGS) as url:
        ours = asyncio.run(run_sweep(url, workload))
    with baseline_server(model) as url:
        baseline = asyncio.run(run_sweep(url, workload))
    for name, results in (("ray serve", ours), ("baseline", baseline)):
        print(name)
        print_table(results)

    c8 = COMPARED_CONCURRENCY
    by_mode = {
        mode: {
            "throughput_ratio_c8": ratio(level(ours, mode, c8).audio_s_per_s, level(baseline, mode, c8).audio_s_per_s),
            "p50_first_chunk_ratio_c8": ratio(
                level(ours, mode, c8).first_chunk_s["p50"], level(baseline, mode, c8).first_chunk_s["p50"]
            ),
            "p50_latency_ratio_c8": ratio(
                level(ours, mode, c8).latency_s["p50"], level(baseline, mode, c8).latency_s["p50"]
            ),
        }
        for mode in workload.modes
    }
    return {
        "throughput_ratio_c8": by_mode["whole"]["throughput_ratio_c8"],
        "p50_first_chunk_ratio_c8": by_mode["stream"]["p50_first_chunk_ratio_c8"],
        "overhead_ratio_c1": ratio(level(ours, "whole", 1).latency_s["p50"], in_process["p50"]),
        "by_mode": by_mode,
        "errors": {"ray_serve": sum(r.errors for r in ours), "baseline": sum(r.errors for r in baseline)},
        "in_process_latency_s": in_process,
        "ray_serve": [asdict(r) for r in ours],
        "baseline": [asdict(r) for r in baseline],
        "setup": {
            "model": model,
            "workload": asdict(workload),
            "ray_app_args": RAY_APP_ARGS,
            "baseline_and_in_process_torch_threads": BASELINE_THREADS,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="tiny", help="tiny (default, minutes on a CPU) or dummy (real size)")
    parser.add_argument("--requests", type=int, default=16, help="requests per mode and concurrency")
    options = parser.parse_args()
    workload = replace(Workload(), concurrencies=(1, COMPARED_CONCURRENCY), requests_per_level=options.requests)
    report = compare(options.model, workload)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(report, indent=2))
    headline = {key: report[key] for key in ("throughput_ratio_c8", "p50_first_chunk_ratio_c8", "overhead_ratio_c1")}
    print(json.dumps({**headline, "errors": report["errors"]}, indent=2))


if __name__ == "__main__":
    main()
