"""The CPU fallback's rates for the autoscaling simulator: a `DecoderCPU` replica's start-up, and what
batching gains it, on the fallback's own precision choice (`dtype: auto`).

    python -m benchmarks.fallback_rates --model cosyvoice3-0.5b --out docs/fallback_rates/cosyvoice3-0.5b.json
        [--seconds 5] [--threads 2] [--repeats 3] [--warmup 1] [--startup-repeats 3] [--skip-startup]

Start-up: the fallback deployment as the app builds it, deployed alone on a local Serve `--startup-repeats` times:
the seconds from `serve.run` to RUNNING (process, model load, first health check: what a scale-up waits for), then
its first request's; a node's own start is not included. Batching: batches of 1 up to the profile's
`decoder_cpu.max_batch_size` through `SpeechDecoderStage.decode_batch`, alternated round by round; per size b the
batch's seconds, its real-time factor (the simulator's `rtf[b]`) and its throughput over batch 1's (outside [0, b]: a
failed measurement). The default run takes about 4 minutes on the 2-core machine (Intel Xeon with AMX, 2026-12-07).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks.engine_bench import bench_parser, fixed_length_segments
from engine.loading.loader import load_model
from engine.nn.precision import cpu_capabilities
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.segment import EncodedSegment
from serve_app.bench.progress import BenchmarkRun
from serve_app.bench.timing import BATCH_RATIO_BOUND, FailedMeasurements, Timing, paired, ratio
from serve_app.decoder_args import CpuFallbackArgs, DecoderArgs

REPOSITORY = Path(__file__).resolve().parents[1]
PROFILE = REPOSITORY / "configs" / "gpu_cluster.yaml"
APP_NAME = "fallback_startup"


def profile_fallback() -> CpuFallbackArgs:
    """The GPU profile's `decoder_cpu` section (its defaults where the profile sets nothing)."""
    (application,) = yaml.safe_load(PROFILE.read_text())["applications"]
    return CpuFallbackArgs.model_validate(application["args"].get("decoder_cpu", {}))


def profile_batch_wait_s() -> float:
    """The GPU profile's admission wait, which its fallback waits too (`decoder.batch_wait_timeout_s`)."""
    (application,) = yaml.safe_load(PROFILE.read_text())["applications"]
    return DecoderArgs.model_validate(application["args"].get("decoder", {})).batch_wait_timeout_s


def batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4 ... up to `max_batch_size`, and `max_batch_size` itself."""
    sizes = [1]
    while sizes[-1] * 2 <= max_batch_size:
        sizes.append(sizes[-1] * 2)
    return sizes if sizes[-1] == max_batch_size else [*sizes, max_batch_size]


def measure_startup(
    model_name: str,
    fallback: CpuFallbackArgs,
    segment: EncodedSegment,
    threads: int,
    repeats: int,
    bench: BenchmarkRun,
) -> dict[str, Any]:
    """Seconds from `serve.run` of the fallback deployment alone to RUNNING, and of its first request, `repeats`
    times on one local Ray (`threads` CPUs)."""
    import ray
    from ray import serve

    from deployments.decoder import Decoder

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a new local Ray would otherwise want a token
    ray.init(address="local", num_cpus=threads, include_dashboard=False, log_to_driver=False)
    ready, first_request = [], []
    try:
        serve.start()
        for repeat in range(repeats):
            app = Decoder.options(name="DecoderCPU", num_replicas=1, ray_actor_options={"num_cpus": threads}).bind(
                model_name,
                use_gpu=False,
                dtype="auto",
                max_batch_size=fallback.max_batch_size,
                batch_wait_timeout_s=profile_batch_wait_s(),
            )
            started = time.perf_counter()
            handle = serve.run(app, name=APP_NAME, route_prefix=None)
            ready.append(time.perf_counter() - started)
            started = time.perf_counter()
            handle.synthesize.remote(segment).result()
            first_request.append(time.perf_counter() - started)
            serve.delete(APP_NAME)
            bench.step(
                f"start-up {repeat + 1}/{repeats}: ready {ready[-1]:.1f} s, first request {first_request[-1]:.1f} s"
            )
    finally:
        serve.shutdown()
        ray.shutdown()
    return {
        **Timing(tuple(ready)).fields("ready_s"),
        **Timing(tuple(first_request)).fields("first_request_s"),
        "replica_num_cpus": threads,
    }


def measure_batches(
    decoder: SpeechDecoderStage,
    segment: EncodedSegment,
    sizes: list[int],
    repeats: int,
    warmup: int,
    bench: BenchmarkRun,
) -> tuple[dict[int, Timing], dict[int, Timing]]:
    """Each batch size's wall seconds and this process's CPU seconds (all its threads) over `repeats` rounds that
    run every size once in turn, after `warmup` rounds. On a shared machine other work stretches the wall time of
    a round but hardly its CPU time: where the two part, the wall figures carry that load."""
    seconds: dict[int, list[float]] = {size: [] for size in sizes}
    cpu_seconds: dict[int, list[float]] = {size: [] for size in sizes}
    for round_ in range(warmup + repeats):
        for size in sizes:
            started, cpu_started = time.perf_counter(), time.process_time()
            outputs = decoder.decode_batch([segment] * size)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            if any(isinstance(output, Exception) for output in outputs):
                raise SystemExit(f"batch {size}: a sentence failed: {outputs}")
            if round_ >= warmup:
                seconds[size].append(elapsed)
                cpu_seconds[size].append(cpu)
            bench.step(
                f"round {round_ + 1}/{warmup + repeats} batch {size}: {elapsed:.2f} s ({cpu:.2f} CPU s)",
                seconds_samples={str(size): seconds[size]},
                cpu_seconds_samples={str(size): cpu_seconds[size]},
            )
    return {size: Timing(tuple(samples)) for size, samples in seconds.items()}, {
        size: Timing(tuple(samples)) for size, samples in cpu_seconds.items()
    }


def batch_rows(
    timings: dict[int, Timing], cpu_timings: dict[int, Timing], audio_s: float, failed: FailedMeasurements
) -> dict[str, dict[str, Any]]:
    """Per batch size: its seconds, real-time factor, CPU seconds, and throughput over batch 1 repeat by repeat,
    bound-checked within [0, size] (null and listed in `failed` outside)."""
    rows: dict[str, dict[str, Any]] = {}
    for size, timing in timings.items():
        throughput_ratio = paired(lambda s, s1, b=size: ratio(b * s1, s), timing, timings[1])
        rows[str(size)] = {
            **timing.fields("seconds"),
            **timing.map(lambda s, b=size: s / (b * audio_s)).fields("rtf"),
            **cpu_timings[size].fields("cpu_seconds"),
            **failed.bounded_fields(
                f"batches.{size}.throughput_vs_b1",
                throughput_ratio,
                0.0,
                float(size),
                BATCH_RATIO_BOUND,
                key="throughput_vs_b1",
            ),
        }
    return rows


def run(
    model_name: str,
    audio_s: float,
    threads: int,
    repeats: int,
    warmup: int,
    startup_repeats: int,
    skip_startup: bool = False,
    bench: BenchmarkRun | None = None,
) -> dict[str, Any]:
    """The report (see the module docstring); the start-up figures and the settings go into `bench`'s report as they
    are known."""
    bench = bench or BenchmarkRun("fallback_rates")
    torch.set_num_threads(threads)
    fallback = profile_fallback()
    sizes = batch_sizes(fallback.max_batch_size)
    bench.plan((0 if skip_startup else startup_repeats) + (warmup + repeats) * len(sizes))
    [segment] = fixed_length_segments(TextEncoderStage(load_model(model_name, components=("encoder",))), audio_s)
    caps = cpu_capabilities()
    result: dict[str, Any] = {
        "model": model_name,
        "dtype": "auto",
        "cpu": {"model": caps.model, "logical_cpus": os.cpu_count()},
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": threads,
        "audio_seconds_per_request": audio_s,
        "max_batch_size": fallback.max_batch_size,
        "max_batch_size_source": f"{PROFILE.relative_to(REPOSITORY)} decoder_cpu (CpuFallbackArgs)",
        "repeats": repeats,
        "warmup": warmup,
        "load_average_before": list(os.getloadavg()),
        # how idle OpenMP threads wait: spinning ones turn other work on a shared machine into many-fold slowdowns
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    bench.record(**result)
    if not skip_startup:
        result["startup"] = measure_startup(model_name, fallback, segment, threads, startup_repeats, bench)
        result["load_average_after_startup"] = list(os.getloadavg())
        bench.record(**result)
    model = load_model(model_name, dtype="auto", components=("decoder",))
    result["precision"] = model.precision.describe()
    decoder = SpeechDecoderStage(model)
    timings, cpu_timings = measure_batches(decoder, segment, sizes, repeats, warmup, bench)
    failed = FailedMeasurements()
    result["batches"] = batch_rows(timings, cpu_timings, audio_s, failed)
    result["rtf"] = {size: row["rtf"] for size, row in result["batches"].items()}
    result["seconds_samples"] = {str(size): list(timing.samples) for size, timing in timings.items()}
    result["cpu_seconds_samples"] = {str(size): list(timing.samples) for size, timing in cpu_timings.items()}
    result["load_average_after"] = list(os.getloadavg())
    result["failed_measurements"] = failed.entries
    return result


def main() -> None:
    parser = bench_parser(__doc__, "fallback_rates.json", 5.0, "audio per request")
    parser.add_argument("--startup-repeats", type=int, default=3, help="fresh deployments of the fallback to time")
    parser.add_argument("--skip-startup", action="store_true", help="time the batches only")
    args = parser.parse_args()
    bench = BenchmarkRun("fallback_rates", args.out)
    result = run(
        args.model,
        args.seconds,
        args.threads,
        args.repeats,
        args.warmup,
        args.startup_repeats,
        args.skip_startup,
        bench,
    )
    bench.finish(result)
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("seconds_samples")}, indent=2))


if __name__ == "__main__":
    main()
