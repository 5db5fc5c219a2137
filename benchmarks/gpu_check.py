"""The engine part of `benchmarks/gpu_check.sh`: the decoder on one device (CUDA fp16 on a GPU machine).

For batch sizes 1, 4 and 16 of fixed-length requests: whether every waveform is finite, the real-time factor
(batch wall time / audio seconds of one request) and the peak device memory of that batch (what one replica
needs for its weights plus that batch); then the first streamed chunk of a 20 s utterance. Each time is the
median of `--repeats` runs after `--warmup` untimed ones, with `<key>_spread` beside it (`benchmarks.timing`).

    python -m benchmarks.gpu_check --out out/gpu_check/engine.json [--device cuda] [--model dummy]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.batching_bench import measure_first_chunk
from benchmarks.engine_bench import fixed_length_segments
from benchmarks.timing import DEFAULT_REPEATS, DEFAULT_WARMUP, add_repeat_options, measure
from engine.loading.loader import load_model
from engine.runtime.pipeline import SpeechDecoderStage, TextEncoderStage
from engine.runtime.segment import EncodedSegment


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_memory_bytes(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def measure_batch(
    decoder: SpeechDecoderStage,
    segment: EncodedSegment,
    batch: int,
    seconds: float,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
) -> dict[str, Any]:
    """`batch` copies of `segment` through the decoder, `repeats` times after `warmup` untimed runs: whether every
    waveform of every run is finite, the median wall time, RTF and throughput with their spread, and the peak
    device memory over the runs."""
    device = str(decoder.model.decoder_device.type)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    outputs = []

    def run() -> None:
        _synchronize(device)  # the clock reads after the device's queue is done, on both sides
        outputs.append(decoder.decode_batch([segment] * batch))
        _synchronize(device)

    _, wall = measure(run, repeats, warmup)
    finite = all(isinstance(r, np.ndarray) and np.isfinite(r).all() and r.size > 0 for out in outputs for r in out)
    return {
        "batch": batch,
        "finite": finite,
        **wall.fields("wall_s"),
        **wall.map(lambda s: s / seconds).fields("rtf"),  # every request of a fixed-length batch ends with the batch
        **wall.map(lambda s: batch * seconds / s).fields("audio_s_per_s"),
        "peak_memory_bytes": peak_memory_bytes(device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--model", default="dummy")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seconds", type=float, default=2.0, help="audio per request of the batches")
    parser.add_argument("--stream-seconds", type=float, default=20.0)
    add_repeat_options(parser)
    options = parser.parse_args()
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    dtype = "float16" if options.device == "cuda" else "float32"
    model = load_model(options.model, dtype=dtype, device=options.device)
    encoder, decoder = TextEncoderStage(model), SpeechDecoderStage(model)
    weights_bytes = peak_memory_bytes(options.device)
    [segment] = fixed_length_segments(encoder, options.seconds)
    repeats, warmup = options.repeats, options.warmup
    rows = [measure_batch(decoder, segment, batch, options.seconds, repeats, warmup) for batch in options.batches]
    for row in rows:
        print(f"batch {row['batch']:2d}: RTF {row['rtf']:.3f}, finite {row['finite']}, peak {row['peak_memory_bytes']}")
    [long_segment] = fixed_length_segments(encoder, options.stream_seconds)
    streaming = measure_first_chunk(decoder, long_segment, repeats, warmup)
    report = {
        "device": options.device,
        "device_name": torch.cuda.get_device_name() if options.device == "cuda" else "cpu",
        "model": options.model,
        "dtype": dtype,
        "repeats": repeats,
        "warmup": warmup,
        "weights_bytes_on_device": weights_bytes,
        "all_finite": all(row["finite"] for row in rows),
        **{f"rtf_b{row['batch']}{suffix}": row[f"rtf{suffix}"] for row in rows for suffix in ("", "_spread")},
        **{f"peak_memory_bytes_b{row['batch']}": row["peak_memory_bytes"] for row in rows},
        "first_chunk_s_20s": streaming["first_chunk_s"],
        "first_chunk_s_20s_spread": streaming["first_chunk_s_spread"],
        "first_chunk_fraction_20s": streaming["fraction"],
        "first_chunk_fraction_20s_spread": streaming["fraction_spread"],
        "batches": rows,
        "streaming_20s": streaming,
    }
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, list | dict)}, indent=2))


if __name__ == "__main__":
    main()
