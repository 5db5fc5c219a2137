"""Ray Serve's modes side by side, on what Serve's own hops cost: Ray's defaults against the parts of Ray 2.60's
`RAY_SERVE_THROUGHPUT_OPTIMIZED` (each its own environment variable) and the whole of it.

Each run is a `python -m benchmarks.compare --hops-only` in a process of its own, whose local Ray starts with the
mode's environment (`overhead_ms_c1`, `stream_first_byte_s_c1`, `stream_bytes_per_s_c8`). What the replicas were
started with is read back from their processes (`replica_env`), so a mode that did not reach them shows. Every round
runs Ray's defaults first and then each other mode, so a shared machine's drifting load hits them alike; a mode's
ratio to that round's defaults is reported as the median with its spread (`serve_app.bench.timing`), a non-finite or
non-positive one as a failed measurement, with the load average before each run (`load_1min`).

The default run (defaults against `throughput-optimized`, 3 rounds) takes about 8 minutes on the 2-core machine,
within its time budget (`--budget-minutes`, default 14; a round left out is named in `stopped`). What it found, and
why the app keeps Ray's defaults: docs/performance.md, "Serve's own hops".

    python -m benchmarks.serve_modes --out out/serve_modes.json [--modes grpc direct-ingress ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from serve_app.bench.progress import BenchmarkRun, add_budget_option
from serve_app.bench.timing import FailedMeasurements, Timing

BUDGET_MINUTES = 14.0
# Ray 2.60's value of each request-path setting this project measured (ray/serve/_private/constants.py).
RAY_DEFAULTS = {
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "0",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
    "RAY_SERVE_LOG_TO_STDERR": "1",
}
RUN_TIMEOUT_S = 600.0  # one compare run: ~70 s here; a hung local Ray must not hold the whole run
FIGURES = ("overhead_ms_c1", "stream_first_byte_s_c1", "stream_bytes_per_s_c8")
THROUGHPUT_OPTIMIZED = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
# Each part of RAY_SERVE_THROUGHPUT_OPTIMIZED on its own (Ray 2.60's ray/serve/_private/constants.py; its fifth part,
# RAY_SERVE_FREEZE_GC_ON_STARTUP, is on by default already).
PARTS = {
    "grpc": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"},
    "user-loop": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"},
    "router-loop": {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"},
    "direct-ingress": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"},
    "log-buffer": {"RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000", "RAY_SERVE_LOG_TO_STDERR": "0"},
}
MODES = (*PARTS, "throughput-optimized")


def mode_env(mode: str) -> dict[str, str]:
    """The variables a mode's run starts its Ray with: Ray's default for each variable the mode does not change;
    the whole RAY_SERVE_THROUGHPUT_OPTIMIZED states none, since its parts take its values only where they are
    unset."""
    if mode == "throughput-optimized":
        return {THROUGHPUT_OPTIMIZED: "1"}
    return dict(RAY_DEFAULTS) | PARTS.get(mode, {})


def run_environment(mode: str, environ: dict[str, str]) -> dict[str, str]:
    """`environ` without any Serve-mode variable of its own (a leftover export would blur the comparison), with the
    mode's."""
    ours = {THROUGHPUT_OPTIMIZED, *RAY_DEFAULTS}  # every part's variables are among RAY_DEFAULTS
    return {key: value for key, value in environ.items() if key not in ours} | mode_env(mode)


def one_run(mode: str, compare_args: list[str]) -> dict[str, Any]:
    """One `compare --hops-only` under `mode` -> its figures, the replicas' Serve environment and the 1-minute load
    average before it started."""
    load_1min = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "hops.json"
        command = [sys.executable, "-m", "benchmarks.compare", "--hops-only", "--out", str(out), *compare_args]
        env = run_environment(mode, dict(os.environ))
        subprocess.run(command, env=env, check=True, timeout=RUN_TIMEOUT_S, stdout=subprocess.DEVNULL)
        report = json.loads(out.read_text())
    figures = {name: report.get(name) for name in FIGURES}
    return {"mode": mode, "load_1min": load_1min, **figures, "replica_env": report.get("replica_env")}


def ratio_to_default(name: str, runs: list[dict[str, Any]], defaults: list[dict[str, Any]]) -> Timing:
    """A mode's figure over the same round's default figure, round by round (NaN where either is missing, or for an
    overhead whose default is not above 0: a ratio of it says nothing)."""

    def one(run: dict[str, Any], default: dict[str, Any]) -> float:
        value, base = run[name], default[name]
        if value is None or base is None or base <= 0:
            return math.nan
        return value / base

    return Timing(tuple(one(run, default) for run, default in zip(runs, defaults, strict=True)))


def summary(rounds: list[dict[str, dict[str, Any]]], modes: list[str], failed: FailedMeasurements) -> dict[str, Any]:
    """Each mode's figures (median and spread over the rounds) and its ratios to the defaults' (taken round by round;
    outside (0, inf): a failed measurement)."""
    defaults = [round_["default"] for round_ in rounds]
    result: dict[str, Any] = {}
    for mode in ["default", *modes]:
        runs = [round_[mode] for round_ in rounds]
        figures: dict[str, Any] = {}
        for name in FIGURES:
            values = [run[name] for run in runs]
            figures |= Timing(tuple(values)).fields(name) if None not in values else {name: None}
            if mode != "default":
                why = f"a ratio of two {name} figures is finite and above 0 (the default's above 0)"
                ratio = ratio_to_default(name, runs, defaults)
                figures |= failed.bounded_fields(
                    f"{mode}.{name}_ratio", ratio, 1e-9, math.inf, why, key=f"{name}_ratio"
                )
        result[mode] = figures
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    modes_help = f"modes compared with Ray's defaults (default: throughput-optimized; any of {', '.join(MODES)})"
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["throughput-optimized"], help=modes_help)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running every mode once (at least 3)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, help="compare's requests per level (default: its profile's)")
    add_budget_option(parser, BUDGET_MINUTES)
    options = parser.parse_args()
    if options.rounds < 3:
        parser.error("--rounds must be at least 3: a median and its spread need them")
    compare_args = ["--model", options.model, "--budget-minutes", "0"]
    compare_args += ["--requests", str(options.requests)] if options.requests else []
    modes = ["default", *options.modes]
    bench = BenchmarkRun("serve_modes", options.out, options.budget_minutes)
    bench.plan(options.rounds * len(modes))
    bench.record(setup={"model": options.model, "rounds": options.rounds, "modes": {m: mode_env(m) for m in modes}})
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(options.rounds):
        if bench.out_of_time(f"round {index + 1}"):
            break
        round_ = {}
        for mode in modes:
            round_[mode] = one_run(mode, compare_args)
            bench.step(f"round {index + 1} {mode}", runs=[*(bench.report.get("runs") or []), round_[mode]])
        rounds.append(round_)
    failed = FailedMeasurements()
    figures = summary(rounds, options.modes, failed) if rounds else {}
    report = bench.finish({"modes": figures, "failed_measurements": failed.entries})
    print(json.dumps({key: report[key] for key in ("modes", "failed_measurements", "complete")}, indent=2))


if __name__ == "__main__":
    main()
