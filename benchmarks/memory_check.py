"""The decoder's memory estimate (engine.runtime.memory) against the memory a decode really takes on CPU.

Each case runs in a fresh process: load the model (the replica's CPU dtype, `auto` unless `--dtype`), decode the
case once (the kernels and workspaces made once per shape, as a replica's are after its first requests), then the
peak resident set is reset (Linux: `/proc/self/clear_refs` with 5) and `batch` copies of one fixed-length sentence
are decoded (tokens, mel, waveform: `SpeechDecoderStage`); the growth of the peak over the resident set before the
decode is the measured bytes, set beside the scheduler's estimate for those sentences (with and without its safety
factor). The margin is estimate / measured: above 1 the budget is safe. Writes JSON.

    python -m benchmarks.memory_check --out out/memory_check.json [--models dummy] [--seconds 5 15] [--batches 1 4]
        [--threads 2] [--dtype auto]
    python -m benchmarks.memory_check --models dummy cosyvoice2-0.5b --out docs/memory_check.json   # both families

The default run takes about 5 minutes on the 2-core machine (281 s, Intel Xeon with AMX, 2026-12-07).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_bench import fixed_length_segments
from engine.loading.loader import load_model
from engine.runtime import memory
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage
from serve_app.bench.progress import BenchmarkRun


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_case(model_name: str, audio_seconds: float, batch: int, threads: int, dtype: str) -> dict[str, Any]:
    """One case in this process (see the module docstring)."""
    torch.set_num_threads(threads)
    model = load_model(model_name, dtype=dtype)
    encoder, decoder = TextEncoderStage(model), SpeechDecoderStage(model)
    segments = fixed_length_segments(encoder, audio_seconds, batch)
    estimate = memory.segment_memory(model.config, segments[0], model.dtype.itemsize)  # the scheduler's
    with torch.inference_mode():  # once untimed at the same shapes: oneDNN's kernels and scratchpads, made once
        decoder.vocode(segments, decoder.tokens_to_mel(segments, decoder.generate_tokens(segments)))
    gc.collect()
    rss_before = _status_kib("VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the present RSS
    with torch.inference_mode():
        tokens = decoder.generate_tokens(segments)
        waves = decoder.vocode(segments, decoder.tokens_to_mel(segments, tokens))
    measured = _status_kib("VmHWM") * 1024 - rss_before
    estimated = batch * estimate.total_bytes
    return {
        "model": model_name,
        "dtype": str(model.dtype).removeprefix("torch."),
        "precision": model.precision.describe(),
        "audio_seconds": sum(len(w) for w in waves) / model.config.sample_rate / batch,
        "batch": batch,
        "speech_tokens": len(tokens[0]),
        "measured_peak_bytes": measured,
        "estimate_bytes": estimated,
        "estimate_bytes_without_safety_factor": round(estimated / memory.SAFETY_FACTOR),
        "estimate_terms_bytes": {
            "kv_cache": batch * estimate.kv_cache_bytes,
            "flow": batch * estimate.flow_bytes,
            "vocoder": batch * estimate.vocoder_bytes,
        },
        "margin": estimated / measured if measured > 0 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("memory_check.json"))
    # one model by default, to fit 15 minutes on 2 cores; the two-family run names both (see above)
    parser.add_argument("--models", nargs="+", default=["dummy"])
    parser.add_argument("--seconds", nargs="+", type=float, default=[5.0, 15.0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--case", nargs=3, metavar=("MODEL", "SECONDS", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:  # a child: one case, its JSON on stdout
        model_name, seconds, batch = args.case
        print(json.dumps(measure_case(model_name, float(seconds), int(batch), args.threads, args.dtype)))
        return
    bench = BenchmarkRun("memory_check", args.out)
    bench.plan(len(args.models) * len(args.seconds) * len(args.batches))
    bench.record(machine={"cpu": platform.processor() or platform.machine(), "threads": args.threads})
    cases = []
    for model_name in args.models:
        for seconds in args.seconds:
            for batch in args.batches:
                command = [sys.executable, "-m", "benchmarks.memory_check", "--threads", str(args.threads)]
                command += ["--dtype", args.dtype, "--case", model_name, str(seconds), str(batch)]
                child = subprocess.run(command, capture_output=True, text=True, check=True)
                cases.append(json.loads(child.stdout.strip().splitlines()[-1]))
                bench.step(f"{model_name} {seconds:g} s batch {batch}: margin {cases[-1]['margin']}", cases=cases)
    margins = [case["margin"] for case in cases if case["margin"] is not None]
    result = bench.finish({"host_memory_bytes": memory.host_memory(), "min_margin": min(margins, default=None)})
    print(json.dumps({key: result[key] for key in ("machine", "min_margin")}))


if __name__ == "__main__":
    main()
