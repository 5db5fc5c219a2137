"""Batching and streaming benchmark on any model family, fixed speech lengths (stop ids masked): the tiny model by
default, a real-size architecture with dummy weights by `--model dummy` (or `cosyvoice3-0.5b`, ...).

For batch sizes 1, 2, 4, 8, 16: throughput (audio seconds per wall second) and per-request latency, for the LLM alone
and the whole decoder; then the first streamed chunk of a 20 s utterance against its whole synthesis
(`first_chunk_fraction_20s`). `--int8` repeats the sweep with an INT8 LLM (keys suffixed `_int8`); `--prompt-seconds
10` adds a repeated-voice run, cached against uncached prompt (`prompt_cache_ttfa_ratio`; `--prompt-cache-only`: only
it). Medians of `--repeats` with spreads (`serve_app.bench.timing`); a batch-8 / batch-1 ratio outside [0, 8] is null.

    python -m benchmarks.batching_bench --out out/batching.json [--model tiny] [--seconds 2] [--batches 1 2 4 8 16]
        [--stream-seconds 20] [--int8] [--repeats 3] [--warmup 1] [--prompt-seconds 10 [--prompt-cache-only]]

The default run (tiny) takes under a minute on the 2-core machine (37 s, Intel Xeon with AMX, 2026-12-07).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.engine_bench import (
    bench_parser,
    fixed_length_sampling,
    fixed_length_segments,
    fixed_length_text_request,
)
from engine.loading.loader import load_model
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.prompt_cache import DEFAULT_PROMPT_CACHE_BYTES, PromptCache
from engine.runtime.segment import EncodedSegment
from engine.voices.cloning import VoicePrompt
from serve_app.bench.progress import BenchmarkRun
from serve_app.bench.timing import (
    BATCH_RATIO_BOUND,
    DEFAULT_REPEATS,
    DEFAULT_WARMUP,
    FailedMeasurements,
    Timing,
    measure,
    paired,
    ratio,
)


def measure_batches(
    decoder: SpeechDecoderStage,
    segments_for: Callable[[int], list[EncodedSegment]],
    batches: list[int],
    audio_seconds: float,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    bench: BenchmarkRun | None = None,
) -> dict[str, Any]:
    """For each batch size, `segments_for(batch)` (fixed-length segments of `audio_seconds` each) through the LLM
    alone, then through the whole decoder; each after `warmup` untimed runs, `repeats` times (`serve_app.bench.timing`).
    Each row keeps its Timings under "timings" (not JSON: `report_rows` drops them); each is a step of `bench`."""
    bench = bench or BenchmarkRun("batches")
    rows = []
    for batch in batches:
        segments = segments_for(batch)
        tokens, llm_s = measure(lambda s=segments: decoder.generate_tokens(s), repeats, warmup)
        _, decoder_s = measure(lambda s=segments: decoder.decode_batch(s), repeats, warmup)
        audio = batch * audio_seconds
        steps = max(len(t) for t in tokens)
        timings = {
            "llm_seconds": llm_s,
            "decoder_seconds": decoder_s,
            "llm_throughput": llm_s.map(lambda s, a=audio: a / s),
            "decoder_throughput": decoder_s.map(lambda s, a=audio: a / s),
            "llm_ms_per_token_step": llm_s.map(lambda s, n=steps: 1000 * s / n),
            "latency_s": decoder_s,  # every request of a fixed-length batch finishes with the batch
        }
        row: dict[str, Any] = {"batch": batch, "timings": timings}
        for name, timing in timings.items():
            row |= timing.fields(name)
        rows.append(row)
        throughputs = f"LLM {row['llm_throughput']:.3f}, decoder {row['decoder_throughput']:.3f} audio s/s"
        bench.step(f"batch {batch}: {throughputs} (median of {repeats})")
    return {"rows": rows}


def report_rows(batching: dict[str, Any]) -> dict[str, Any]:
    """`measure_batches`' result for the JSON: the rows without their Timing objects."""
    return {"rows": [{k: v for k, v in row.items() if k != "timings"} for row in batching["rows"]]}


def throughput_ratios(
    rows: list[dict[str, Any]], batch: int, failed: FailedMeasurements, suffix: str = ""
) -> dict[str, Any]:
    """`<part>_throughput_ratio_b<batch>_vs_b1<suffix>` for the LLM alone and the whole decoder: the median of the
    repeat-by-repeat ratios and their spread, bound-checked within [0, batch] (null and listed in `failed`
    outside)."""
    by_batch = {r["batch"]: r["timings"] for r in rows}
    result: dict[str, Any] = {}
    for part in ("llm", "decoder"):
        key = f"{part}_throughput"
        throughput = paired(ratio, by_batch[batch][key], by_batch[1][key])
        result |= failed.bounded_fields(
            f"{part}_throughput_ratio_b{batch}_vs_b1{suffix}", throughput, 0.0, float(batch), BATCH_RATIO_BOUND
        )
    return result


def measure_first_chunk(
    decoder: SpeechDecoderStage, segment: EncodedSegment, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP
) -> dict[str, Any]:
    """Seconds to the first non-empty chunk of streaming `segment` and to its end, and of its whole (non-streamed)
    synthesis, and the first chunk's fraction of the whole synthesis (repeat by repeat); each the median of
    `repeats` runs after `warmup` untimed ones, with its spread."""
    firsts: list[float | None] = []

    def stream() -> None:
        start, first = time.perf_counter(), None
        for outputs in decoder.open_stream([segment]):
            if first is None and outputs[0] is not None and len(outputs[0]):
                first = time.perf_counter() - start
        firsts.append(first)

    _, stream_total = measure(stream, repeats, warmup)
    firsts = firsts[warmup:]
    _, full = measure(lambda: decoder.decode_batch([segment]), repeats, warmup)
    result: dict[str, Any] = {**stream_total.fields("stream_total_s"), **full.fields("full_synthesis_s")}
    if None in firsts:  # no audio came: no first chunk to report
        missing = {"first_chunk_s": None, "first_chunk_s_spread": None, "fraction": None, "fraction_spread": None}
        return {**missing, **result}
    first = Timing(tuple(firsts))
    return {**first.fields("first_chunk_s"), **result, **paired(ratio, first, full).fields("fraction")}


PROMPT_TRANSCRIPT = (
    "This is a recording of my own voice, about ten seconds long, that the server keeps and uses again for every "
    "request spoken in it, so that each new sentence sounds like me."
)


def synthetic_prompt(encoder: TextEncoderStage, prompt_seconds: float) -> VoicePrompt:
    """A voice prompt as `VoiceCloner.clone` makes it from a `prompt_seconds` recording: random speaker embedding,
    speech tokens and mel of that recording's lengths, and PROMPT_TRANSCRIPT."""
    config = encoder.model.config
    rng = np.random.default_rng(0)
    tokens = config.speech_tokens_for(prompt_seconds)
    return VoicePrompt(
        transcript=PROMPT_TRANSCRIPT,
        embedding=rng.standard_normal(192).astype(np.float32),
        speech_tokens=rng.integers(0, encoder.model.llm.eos, tokens).astype(np.int64),
        speech_feat=rng.standard_normal((config.flow.mel_frames_of(tokens), config.mel_bins)).astype(np.float32),
        sample_rate=config.sample_rate,
        family=config.family.name,
    )


def cloned_voice_segment(encoder: TextEncoderStage, prompt_seconds: float, audio_seconds: float) -> EncodedSegment:
    """`fixed_length_text_request` in a zero-shot voice cloned from a synthetic `prompt_seconds` prompt (random
    speaker embedding, speech tokens and mel of the lengths a recording that long gives, as `VoiceCloner.clone`
    makes them), as the encoder makes it for a registered voice."""
    config = encoder.model.config
    prompt = synthetic_prompt(encoder, prompt_seconds)
    request = replace(fixed_length_text_request(encoder, audio_seconds), voice="voice_benchmark")
    [text] = encoder.segment_texts(request, prompt)  # the target text's length fixes the speech length
    sampling = fixed_length_sampling(len(text.text), config.speech_tokens_for(audio_seconds))
    [segment] = encoder.encode(replace(request, sampling=sampling), prompt)
    return segment


def measure_prompt_cache_ttfa(
    decoder: SpeechDecoderStage, segment: EncodedSegment, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP
) -> dict[str, Any]:
    """Seconds to the first non-empty chunk of streaming `segment` (a cloned voice) with the decoder's prompt cache
    holding the voice's prepared prompt, and with no cache; the two alternate, in turns of order (uncached first,
    then cached first), so that load on a shared machine hits both alike. `warmup` untimed pairs first (the first
    cached run fills the cache), then `repeats` timed pairs: the medians, their spreads, and the repeat-by-repeat
    ratio cached / uncached."""
    cache = PromptCache(DEFAULT_PROMPT_CACHE_BYTES)

    def first_chunk(cached: bool) -> float:
        decoder.prompt_cache = cache if cached else None
        start = time.perf_counter()
        for outputs in decoder.open_stream([segment]):
            if outputs[0] is None:
                break
            if len(outputs[0]):
                return time.perf_counter() - start
        raise SystemExit("the stream ended without audio: no first chunk to time")

    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for index in range(warmup + repeats):
            for cached in (False, True) if index % 2 == 0 else (True, False):
                seconds = first_chunk(cached)
                if index >= warmup:
                    times[cached].append(seconds)
    finally:
        decoder.prompt_cache = None
    uncached, cached = Timing(tuple(times[False])), Timing(tuple(times[True]))
    entry = cache.get((segment.voice, segment.prompt_key), count=False)
    return {
        **cached.fields("ttfa_cached_s"),
        **uncached.fields("ttfa_uncached_s"),
        **paired(ratio, cached, uncached).fields("ratio"),
        "prompt_speech_tokens": len(segment.llm_prompt_speech_tokens),
        "prefill_rows": len(decoder.model.llm.lm_input(decoder.generation_requests([segment])[0])),
        "cached_prefix_rows": None if entry is None or entry.prefix is None else entry.prefix.rows,
        "cache_hits": cache.stats.hits,
        "cache_misses": cache.stats.misses,
        "cache_bytes": cache.nbytes,
    }


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
    # the real-size sweep is far beyond 15 minutes on 2 cores (see the docstring): it is `--model dummy`
    parser.set_defaults(model="tiny")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--stream-seconds", type=float, default=20.0)
    parser.add_argument("--int8", action="store_true", help="also sweep with an INT8 decoder LLM")
    parser.add_argument(
        "--prompt-seconds",
        type=float,
        default=0.0,
        help="also time the first chunk in a voice cloned from a prompt this long, with and without the prompt cache "
        "(0: not run)",
    )
    parser.add_argument(
        "--prompt-cache-only", action="store_true", help="run only the prompt cache timing (with --prompt-seconds)"
    )
    args = parser.parse_args()
    if args.prompt_cache_only and args.prompt_seconds <= 0:
        parser.error("--prompt-cache-only needs --prompt-seconds")
    if 1 not in args.batches:
        parser.error("--batches must include 1 (what the throughput ratios compare with)")
    torch.set_num_threads(args.threads)

    bench = BenchmarkRun("batching_bench", args.out)
    precisions = (False, True) if args.int8 else (False,)
    prompt_cache_steps = 1 if args.prompt_seconds > 0 else 0
    sweep_steps = 0 if args.prompt_cache_only else len(precisions) * len(args.batches) + 1  # + the stream
    bench.plan(prompt_cache_steps + sweep_steps)
    bench.record(
        model=args.model,
        threads=args.threads,
        audio_seconds_per_request=args.seconds,
        repeats=args.repeats,
        warmup=args.warmup,
    )
    failed = FailedMeasurements()
    if args.prompt_seconds > 0:
        model = load_model(args.model)
        segment = cloned_voice_segment(TextEncoderStage(model), args.prompt_seconds, args.seconds)
        timing = measure_prompt_cache_ttfa(SpeechDecoderStage(model), segment, args.repeats, args.warmup)
        ratio_fields = {
            "prompt_cache_ttfa_ratio": timing["ratio"],
            "prompt_cache_ttfa_ratio_spread": timing["ratio_spread"],
        }
        bench.step("prompt cache", **{f"prompt_cache_{args.prompt_seconds:g}s": timing, **ratio_fields})
        print(json.dumps(timing, indent=2))
        del model
    if args.prompt_cache_only:
        bench.finish()
        return
    for int8 in precisions:
        suffix = "_int8" if int8 else ""
        print(f"-- decoder LLM in {'INT8' if int8 else 'float32'}")
        model = load_model(args.model, int8=int8)
        encoder, decoder = TextEncoderStage(model), SpeechDecoderStage(model)
        batching = measure_batches(
            decoder,
            lambda n, e=encoder: fixed_length_segments(e, args.seconds, n),
            args.batches,
            args.seconds,
            args.repeats,
            args.warmup,
            bench,
        )
        b1 = next(r for r in batching["rows"] if r["batch"] == 1)["timings"]
        figures = {f"batching{suffix}": report_rows(batching)}
        figures |= b1["decoder_seconds"].map(lambda s: s / args.seconds).fields(f"rtf_b1{suffix}")
        figures |= b1["llm_ms_per_token_step"].fields(f"llm_ms_per_token_b1{suffix}")
        if 8 in args.batches:
            figures |= throughput_ratios(batching["rows"], 8, failed, suffix)
        bench.record(**figures, failed_measurements=failed.entries)
        if not int8:
            [segment] = fixed_length_segments(encoder, args.stream_seconds)
            streaming = measure_first_chunk(decoder, segment, args.repeats, args.warmup)
            name = f"first_chunk_fraction_{args.stream_seconds:g}s"
            bench.step(
                f"first chunk of {args.stream_seconds:g} s",
                **{f"streaming_{args.stream_seconds:g}s": streaming},
                **{name: streaming["fraction"], f"{name}_spread": streaming["fraction_spread"]},
            )
        del model, encoder, decoder
    result = bench.finish()
    plot(result, args.out.with_suffix(".png"))
    summary = {k: v for k, v in result.items() if not isinstance(v, dict | list)}
    print(json.dumps(summary, indent=2))
    for entry in failed.entries:
        print(f"failed measurement: {entry['name']} = {entry['value']} ({entry['why']})")


if __name__ == "__main__":
    main()
