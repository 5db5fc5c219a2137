"""What holding rows costs the decoder loop on CPU. While a stream generates toward its first audio, the generating
rows with time to spare sit out the LLM steps (`Scheduler(hold_rows=...)`), their KV caches set aside, and rejoin
afterwards. This times one such cycle for 7 of 8 rows of one LLM batch, the rows leaving and rejoining one call per
row (as the loop did before) against all in one `TokenGenerator.pause` / `resume` (as it does now), beside one LLM
step of the 8 rows; the three are taken in turns, repeat by repeat.

    python -m benchmarks.hold_cycle --out out/hold_cycle.json [--model dummy] [--tokens 100] [--threads 1]

Keys: `llm_step_s`, `hold_cycle_s_one_by_one`, `hold_cycle_s_together` (medians; `_spread` beside each) and
`hold_cycle_ratio` (one by one / together, repeat by repeat). The default run takes less than a minute (25 s) on
the 2-core machine (Intel Xeon with AMX, 2026-12-07).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.llm.generation import TokenGenerator
from engine.llm.sampling import SamplingOptions
from engine.runtime.pipeline import CosyVoice
from engine.runtime.synthesis_request import SynthesisRequest
from serve_app.bench.progress import BenchmarkRun
from serve_app.bench.timing import FailedMeasurements, Timing, add_repeat_options, paired, ratio

ROWS, HELD = 8, 7
TEXT = "This is a much longer request that keeps the decoder busy for a while."


def _seconds(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


@torch.inference_mode()
def run(
    model_name: str, tokens: int, threads: int, repeats: int, warmup: int, bench: BenchmarkRun | None = None
) -> dict:
    """8 copies of one sentence (none may stop during the run) stepped `tokens` times, then `warmup` untimed and
    `repeats` timed rounds (a round: a step, a cycle one by one, a step, a cycle together, a step); each round's
    seconds go into `bench`'s report (`seconds_samples`) as it ends."""
    bench = bench or BenchmarkRun("hold_cycle")
    bench.plan(1 + warmup + repeats)  # the first `tokens` steps, then the rounds
    torch.set_num_threads(threads)
    tts = CosyVoice.load(model_name)
    [probe] = tts.encoder.encode(SynthesisRequest(TEXT, tts.voices[0]))
    per_text_token = math.ceil((tokens + 3 * (warmup + repeats)) / probe.text_len) + 1  # no row stops in the run
    sampling = SamplingOptions(
        seed=1,
        min_token_text_ratio=per_text_token,
        max_token_text_ratio=per_text_token,
        mask_all_stop_ids_before_min_len=True,
    )
    [segment] = tts.encoder.encode(SynthesisRequest(TEXT, tts.voices[0], sampling=sampling))
    generator = TokenGenerator(tts.decoder.model.llm)
    ids = [generator.add(request) for request in tts.decoder.generation_requests([segment] * ROWS)]
    held = ids[-HELD:]
    for _ in range(tokens):
        generator.step()
    bench.step(f"{tokens} tokens")

    def one_by_one() -> None:
        for request_id in held:
            generator.pause([request_id], keep_cache=True)
        for request_id in held:
            generator.resume([request_id])

    def together() -> None:
        generator.pause(held, keep_cache=True)
        generator.resume(held)

    samples: dict[str, list[float]] = {"step": [], "one_by_one": [], "together": []}
    for round_ in range(warmup + repeats):
        taken = {"step": _seconds(generator.step), "one_by_one": _seconds(one_by_one)}
        generator.step()  # the rejoined rows are prefilled or merged: the next cycle starts from a full batch
        taken["together"] = _seconds(together)
        generator.step()
        if round_ >= warmup:
            for name, seconds in taken.items():
                samples[name].append(seconds)
        bench.step(f"round {round_ + 1}/{warmup + repeats}", seconds_samples=samples)
    timings = {name: Timing(tuple(values)) for name, values in samples.items()}
    failed = FailedMeasurements()
    cycle_ratio = paired(ratio, timings["one_by_one"], timings["together"])
    return {
        "model": model_name,
        "threads": threads,
        "rows": ROWS,
        "held_rows": HELD,
        "tokens": tokens,
        "repeats": repeats,
        "warmup": warmup,
        **timings["step"].fields("llm_step_s"),
        **timings["one_by_one"].fields("hold_cycle_s_one_by_one"),
        **timings["together"].fields("hold_cycle_s_together"),
        **failed.bounded_fields(
            "hold_cycle_ratio", cycle_ratio, 0.0, math.inf, "a ratio of two durations is positive and finite"
        ),
        "failed_measurements": failed.entries,
        "seconds_samples": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("hold_cycle.json"))
    parser.add_argument("--model", default="dummy", help="preset (dummy = real-size CosyVoice-300M) or model dir")
    parser.add_argument("--tokens", type=int, default=100, help="tokens each row has when the cycles are timed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the loop thread's share of 2 cores)")
    add_repeat_options(parser)
    parser.set_defaults(repeats=7)
    args = parser.parse_args()
    bench = BenchmarkRun("hold_cycle", args.out)
    result = bench.finish(run(args.model, args.tokens, args.threads, args.repeats, args.warmup, bench))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
