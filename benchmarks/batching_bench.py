"""Batching and streaming benchmark on a real-size dummy model of any family, fixed speech lengths (stop ids masked).

For batch sizes 1, 2, 4, 8, 16: throughput (audio seconds per wall second) and per-request latency, for
the LLM alone and for the whole decoder (LLM + flow + HiFT); then the time to the first streamed chunk
of a 20 s utterance against its full (non-streaming) synthesis time. All in one process, side by side.

    python -m benchmarks.batching_bench --out out/batching.json [--model dummy] [--seconds 2] [--batches 1 2 4 8 16]
        [--stream-seconds 20] [--int8]

The streaming keys name the utterance's length (`first_chunk_fraction_20s` for `--stream-seconds 20`).

The headline keys are for float32 weights; `--int8` repeats the sweep with the decoder LLM INT8-quantized (the
CPU configuration: `load_model(..., int8=True)`) and adds the same keys with an `_int8` suffix.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from benchmarks.engine_bench import bench_parser, fixed_length_segments, timed, write_json
from engine.loader import load_model
from engine.pipeline import EncodedSegment, SpeechDecoderStage, TextEncoderStage


def measure_batches(decoder: SpeechDecoderStage, segments_for, batches: list[int], audio_seconds: float) -> dict:
    """For each batch size, `segments_for(batch)` (fixed-length segments of `audio_seconds` each) through the LLM
    alone, then through the whole decoder."""
    rows = []
    for batch in batches:
        segments = segments_for(batch)
        tokens, llm_s = timed(decoder.generate_tokens, segments)
        _, decoder_s = timed(decoder.decode_batch, segments)
        audio = batch * audio_seconds
        rows.append(
            {
                "batch": batch,
                "llm_seconds": llm_s,
                "decoder_seconds": decoder_s,
                "llm_throughput": audio / llm_s,
                "decoder_throughput": audio / decoder_s,
                "llm_ms_per_token_step": 1000 * llm_s / max(len(t) for t in tokens),
                "latency_s": decoder_s,  # every request of a fixed-length batch finishes with the batch
            }
        )
        row = rows[-1]
        print(f"batch {batch:2d}: LLM {row['llm_throughput']:.3f}, decoder {row['decoder_throughput']:.3f} audio s/s")
    return {"rows": rows}


def measure_first_chunk(decoder: SpeechDecoderStage, segment: EncodedSegment) -> dict:
    start = time.perf_counter()
    first = None
    for outputs in decoder.open_stream([segment]):
        if first is None and outputs[0] is not None and len(outputs[0]):
            first = time.perf_counter() - start
    stream_total = time.perf_counter() - start
    _, full = timed(decoder.decode_batch, [segment])
    return {"first_chunk_s": first, "stream_total_s": stream_total, "full_synthesis_s": full}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["batching"]["rows"]
    batches = [r["batch"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(batches, [r["llm_throughput"] for r in rows], "o-", label="LLM alone")
    left.plot(batches, [r["decoder_throughput"] for r in rows], "s-", label="whole decoder")
    if "batching_int8" in result:
        rows8 = result["batching_int8"]["rows"]
        left.plot(batches, [r["llm_throughput"] for r in rows8], "o--", label="LLM alone, INT8")
        left.plot(batches, [r["decoder_throughput"] for r in rows8], "s--", label="whole decoder, INT8 LLM")
    left.set(xscale="log", xlabel="batch size", ylabel="audio seconds per wall second", title="Throughput")
    left.set_xticks(batches, [str(b) for b in batches])
    left.legend()
    right.plot(batches, [r["latency_s"] for r in rows], "s-", color="C1")
    right.set(xscale="log", xlabel="batch size", ylabel="seconds", title="Per-request latency (whole decoder)")
    right.set_xticks(batches, [str(b) for b in batches])
    fig.suptitle(f"{result['model']}, {result['threads']} threads, {result['audio_seconds_per_request']} s per request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = bench_parser(__doc__, "batching_bench.json", 2.0, "audio per request in the batch sweep")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--stream-seconds", type=float, default=20.0)
    parser.add_argument("--int8", action="store_true", help="also sweep with an INT8 decoder LLM")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    result: dict = {"model": args.model, "threads": args.threads, "audio_seconds_per_request": args.seconds}
    for int8 in (False, True) if args.int8 else (False,):
        suffix = "_int8" if int8 else ""
        print(f"-- decoder LLM in {'INT8' if int8 else 'float32'}")
        model = load_model(args.model, int8=int8)
        encoder, decoder = TextEncoderStage(model), SpeechDecoderStage(model)
        decoder.decode_batch(fixed_length_segments(encoder, 0.5))  # warm-up
        batching = measure_batches(
            decoder, lambda n, e=encoder: fixed_length_segments(e, args.seconds, n), args.batches, args.seconds
        )
        by_batch = {r["batch"]: r for r in batching["rows"]}
        result[f"batching{suffix}"] = batching
        result[f"rtf_b1{suffix}"] = 1 / by_batch[1]["decoder_throughput"]
        result[f"llm_ms_per_token_b1{suffix}"] = by_batch[1]["llm_ms_per_token_step"]
        if 8 in by_batch:
            for part in ("llm", "decoder"):
                ratio = by_batch[8][f"{part}_throughput"] / by_batch[1][f"{part}_throughput"]
                result[f"{part}_throughput_ratio_b8_vs_b1{suffix}"] = ratio
        if not int8:
            [segment] = fixed_length_segments(encoder, args.stream_seconds)
            streaming = measure_first_chunk(decoder, segment)
            result[f"streaming_{args.stream_seconds:g}s"] = streaming
            fraction = streaming["first_chunk_s"] / streaming["full_synthesis_s"]
            result[f"first_chunk_fraction_{args.stream_seconds:g}s"] = fraction
        del model, encoder, decoder
    write_json(result, args.out)
    plot(result, args.out.with_suffix(".png"))
    summary = {k: v for k, v in result.items() if not isinstance(v, dict)}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
