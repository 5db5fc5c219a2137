"""The plan against the card: `cosyvoice-serve run --model M` started as the reader starts it, its printed plan checked
against the plan for this machine (`serve_app.plan`), the GPU processes nvidia-smi shows against the plan's replicas
and memory, then streamed requests through it: the time to each one's first audio byte, and each replica's peak
memory (nvidia-smi's per-process figure, sampled while they run) against the plan's footprint per replica.

    python -m benchmarks.plan_check --model cosyvoice3-0.5b --out OUT/plan_check.json

`benchmarks/gpu_check.sh` runs it as its `plan_check` part (the real-size v3 dummy on the card; with --cpu the tiny
model on CPU, where nvidia-smi has nothing to show). The JSON is written as the check goes. A complete one from a GPU,
copied into docs/gpu_check/, is a recorded footprint: its largest peak per replica replaces the plan's estimate for the
same replica on a card of that name (`serve_app.footprints.recorded_footprints`), in `run`, `plan` and this check.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from engine.loading.loader import model_sizes
from serve_app.args import AppArgs
from serve_app.bench.http_load import free_port, wait_until_answering
from serve_app.footprints import recorded_footprints
from serve_app.inventory import inventory_here
from serve_app.plan import Plan, plan_for

TEXT = "Hello from CosyVoice. This sentence streams while the next one is made, as a voice agent's would."
SAMPLE_S = 0.5


def gpu_process_memory() -> dict[int, int] | None:
    """Bytes each process holds on the GPUs (nvidia-smi's compute apps, summed per pid); None without nvidia-smi."""
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    used: dict[int, int] = {}
    for line in result.stdout.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            used[int(pid)] = used.get(int(pid), 0) + int(mib) * 2**20
    return used


class PeakSampler:
    """Each GPU process's peak memory, sampled every SAMPLE_S in a thread while it runs."""

    def __init__(self) -> None:
        self.peaks: dict[int, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            used = gpu_process_memory() or {}
            self.samples += 1
            for pid, size in used.items():
                self.peaks[pid] = max(self.peaks.get(pid, 0), size)
            self._stop.wait(SAMPLE_S)


def first_audio_s(url: str, timeout_s: float) -> float:
    """Seconds from a streamed /v1/tts request to its first audio byte; the stream is read to its end."""
    start = time.monotonic()
    first = None
    body = {"text": TEXT, "format": "pcm", "stream": True, "seed": 1, "sampling": {"max_token_text_ratio": 3}}
    with httpx.stream("POST", f"{url}/v1/tts", json=body, timeout=timeout_s) as response:
        response.raise_for_status()
        for piece in response.iter_bytes():
            if piece and first is None:
                first = time.monotonic() - start
    if first is None:
        raise RuntimeError("the stream ended without audio")
    return first


def check(options: argparse.Namespace, report: dict[str, Any], write: Any) -> None:
    args = AppArgs(model=options.model)
    # the footprints recorded so far, as the server's own plan takes them
    plan: Plan = plan_for(inventory_here(), model_sizes(options.model), args, options.device, recorded_footprints())
    report["plan"] = plan.to_json()
    write()
    port = free_port()
    log_path = options.out.with_suffix(".server.log")
    command = [sys.executable, "-m", "serve_app.cli", "run", "--model", options.model, "--port", str(port)]
    command += ["--device", options.device]
    gpu_before = gpu_process_memory()
    with log_path.open("wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_answering(f"{url}/healthz", server, "the server", options.start_timeout_s)
            printed = log_path.read_text(errors="replace")
            # the lines after the first, which names the CPUs as this process counts them (Ray may count others)
            report["printed_plan_matches"] = all(line in printed for line in plan.lines()[1:])
            gpu_at_start = gpu_process_memory()
            new = {pid: size for pid, size in (gpu_at_start or {}).items() if pid not in (gpu_before or {})}
            report["gpu_processes_at_start"] = None if gpu_at_start is None else len(new)
            report["gpu_processes_expected"] = plan.min_replicas if plan.device == "cuda" else 0
            write()
            with PeakSampler() as sampler, ThreadPoolExecutor(options.concurrency) as pool:
                waits = list(pool.map(lambda _: first_audio_s(url, options.request_timeout_s), range(options.requests)))
            report["first_audio_s"] = [round(wait, 3) for wait in waits]
            report["first_audio_max_s"] = round(max(waits), 3)
            peaks = {pid: size for pid, size in sampler.peaks.items() if pid not in (gpu_before or {})}
            report["nvml_samples"] = sampler.samples if gpu_at_start is not None else 0
            report["per_replica_peak_bytes"] = sorted(peaks.values()) if gpu_at_start is not None else None
            planned = plan.memory.total_bytes if plan.memory is not None else None
            report["per_replica_planned_bytes"] = planned
            report["within_plan"] = None if planned is None or not peaks else max(peaks.values()) <= planned
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                report["server_exit"] = server.wait(options.stop_timeout_s)
            except subprocess.TimeoutExpired:
                server.kill()
                report["server_exit"] = "killed: it did not stop in time"
    report["complete"] = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cosyvoice3-0.5b", help="a preset, model dir or hub id (as run's --model)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--requests", type=int, default=8, help="streamed requests")
    parser.add_argument("--concurrency", type=int, default=4, help="at once (the article's batches of 4)")
    parser.add_argument("--start-timeout-s", type=float, default=240.0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--stop-timeout-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, required=True)
    options = parser.parse_args(argv)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"model": options.model, "device": options.device, "complete": False}

    def write() -> None:
        options.out.write_text(json.dumps(report, indent=2))

    try:
        check(options, report, write)
    except Exception as exc:  # the JSON says what failed; the script's exit code says that it did
        report["error"] = f"{type(exc).__name__}: {exc}"
        write()
        print(f"plan_check: {report['error']}", file=sys.stderr)
        return 1
    write()
    print(json.dumps({key: value for key, value in report.items() if key != "plan"}))
    ok = report["printed_plan_matches"] and report["within_plan"] is not False
    ok = ok and report["gpu_processes_at_start"] in (None, report["gpu_processes_expected"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
