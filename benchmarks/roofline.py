"""How close one batch-1 synthesis runs to this machine's limits, stage by stage (why RTF 3.0 at
batch 1 was out of reach).

- Machine: the best GEMM rate over a few shapes (the compute ceiling: convolutions and attention lower to GEMMs).
- Flow and HiFT: their FLOPs (torch's FlopCounterMode over the real call, plus the fused CPU attention kernel it does
  not count) divided by that ceiling: the stage's time at 100% of peak.
- LLM: at batch 1 each decode step reads every weight of its Linear layers once, so its floor is the time of exactly
  those layers (found with forward hooks on a real step) run alone on one row, back to back.

    python -m benchmarks.roofline --out out/roofline.json [--model dummy] [--seconds 5] [--int8] [--repeats 3]

Medians with spreads (`serve_app.bench.timing`; the weight-read floor of 20 runs); an efficiency (floor / time) above
1 is a failed measurement. `rtf_floor` adds the three floors; `efficiency_needed_for_rtf_3` is the fraction of that
ideal the whole decoder must reach for RTF 3.0 (above 1: out of reach here whatever the code). The default run takes
about 2 minutes on the 2-core machine (Intel Xeon with AMX, 2026-12-07).
"""

from __future__ import annotations

import json
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.nn.quantized import dynamic as quantized_dynamic
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from benchmarks.engine_bench import bench_parser, fixed_length_segments
from engine.llm.generation import TokenGenerator
from engine.loading.loader import load_model
from engine.nn.layers import PackedLinear
from engine.nn.precision import parameter_bytes
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage
from serve_app.bench.progress import BenchmarkRun
from serve_app.bench.timing import DEFAULT_REPEATS, DEFAULT_WARMUP, FailedMeasurements, Timing, measure, paired

GEMM_SHAPES = ((860, 256, 1024), (860, 1024, 256), (1024, 1024, 1024), (2048, 2048, 2048))  # (M, K, N)
_LINEAR_TYPES = (nn.Linear, PackedLinear, quantized_dynamic.Linear)
READ_REPEATS = 20  # timed runs of the LLM's weight-read floor (one decode step's Linear layers: milliseconds)


def _cpu_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def counted_flops(fn, *args) -> int:
    """FLOPs of fn(*args), the CPU flash-attention kernel included."""
    counter = FlopCounterMode(
        display=False,
        custom_mapping={torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops},
    )
    with counter:
        fn(*args)
    return counter.get_total_flops()


def sustained_gflops(a: torch.Tensor, w: torch.Tensor, seconds: float) -> float:
    """The GEMM rate of `F.linear(a, w)` called back to back for about `seconds` (GFLOPS)."""
    (m, k), n = a.shape, w.shape[0]
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        F.linear(a, w)
        calls += 1
    return 2 * m * k * n * calls / elapsed / 1e9


def peak_gemm_gflops(
    seconds_per_shape: float = 1.0, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP
) -> tuple[dict[str, Any], float]:
    """Sustained float32 GEMM rate per shape 'MxKxN' (GFLOPS, averaged over about a second, as long as a stage
    runs: short bursts run at a higher clock), the median of `repeats` such seconds after `warmup` untimed calls,
    with its spread -> (those fields and 'peak': the best shape's median; the peak)."""
    fields: dict[str, Any] = {}
    medians = []
    for m, k, n in GEMM_SHAPES:
        a, w = torch.randn(m, k), torch.randn(n, k)
        for _ in range(warmup):
            F.linear(a, w)
        rate = Timing(tuple(sustained_gflops(a, w, seconds_per_shape) for _ in range(repeats)))
        fields |= rate.fields(f"{m}x{k}x{n}")
        medians.append(rate.median)
    return {**fields, "peak": max(medians)}, max(medians)


def per_token_linears(model: nn.Module, request) -> list[nn.Module]:
    """The Linear layers one decode step of `model` (a speech-token LM) runs, in call order."""
    generator = TokenGenerator(model)
    generator.add(request)
    generator.step()  # the prefill; the next step decodes one token
    fired: list[nn.Module] = []
    hooks = [
        module.register_forward_hook(lambda module, args, out: fired.append(module))
        for module in model.modules()
        if isinstance(module, _LINEAR_TYPES)
    ]
    try:
        generator.step()
    finally:
        for hook in hooks:
            hook.remove()
    return fired


def linear_read_seconds(layers: list[nn.Module], warmup: int = DEFAULT_WARMUP) -> Timing:
    """One row through every layer in turn: the weight-read time of a batch-1 decode step (READ_REPEATS times:
    one step is milliseconds)."""
    rows = [torch.randn(1, layer.in_features) for layer in layers]

    def run() -> None:
        for layer, row in zip(layers, rows, strict=True):
            layer(row)

    with torch.inference_mode():
        return measure(run, READ_REPEATS, warmup)[1]


def run(
    model_name: str,
    audio_seconds: float,
    threads: int,
    int8: bool,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    gemm_seconds_per_shape: float = 1.0,
    bench: BenchmarkRun | None = None,
) -> dict[str, Any]:
    """Each stage's time (the median of `repeats` after `warmup` untimed calls) against its floor on this machine;
    an efficiency (floor / time) above 1 is a failed measurement (`failed_measurements`), not a result. Each
    stage's seconds go into `bench`'s report as they are taken (`stages`, completed at the end)."""
    bench = bench or BenchmarkRun("roofline")
    bench.plan(6)  # three stages, their FLOPs, the GEMM peak, the weight-read floor
    torch.set_num_threads(threads)
    model = load_model(model_name, int8=int8)
    decoder = SpeechDecoderStage(model)
    segments = fixed_length_segments(TextEncoderStage(model), audio_seconds)

    with torch.inference_mode():
        tokens, llm_s = measure(partial(decoder.generate_tokens, segments), repeats, warmup)
        bench.step("llm", stages={"llm": llm_s.fields("seconds")})
        mels, flow_s = measure(partial(decoder.tokens_to_mel, segments, tokens), repeats, warmup)
        bench.step("flow", stages={"flow": flow_s.fields("seconds")})
        waves, hift_s = measure(partial(decoder.vocode, segments, mels), repeats, warmup)
        bench.step("hift", stages={"hift": hift_s.fields("seconds")})
        flow_flops = counted_flops(decoder.tokens_to_mel, segments, tokens)
        hift_flops = counted_flops(decoder.vocode, segments, mels)
    bench.step("FLOPs counted")
    audio = sum(len(w) for w in waves) / model.config.sample_rate
    n_tokens = sum(len(t) for t in tokens)

    gemm, peak = peak_gemm_gflops(gemm_seconds_per_shape, repeats, warmup)
    bench.step("GEMM peak", gemm_gflops=gemm)
    layers = per_token_linears(model.llm, decoder.generation_requests(segments)[0])
    read_s = linear_read_seconds(layers, warmup)
    bench.step("weight-read floor")
    read_bytes = sum(parameter_bytes(layer) for layer in layers)
    failed = FailedMeasurements()

    def stage(name: str, seconds: Timing, floor: float, **figures: Any) -> dict[str, Any]:
        efficiency = seconds.map(lambda s: floor / s)
        bound = f"the {name} stage cannot run faster than its floor"
        return {
            **seconds.fields("seconds"),
            **figures,
            "floor_seconds": floor,
            **failed.bounded_fields(f"stages.{name}.efficiency", efficiency, 0.0, 1.0, bound, key="efficiency"),
        }

    def compute_stage(name: str, seconds: Timing, flops: int) -> dict[str, Any]:
        rate = seconds.map(lambda s: flops / s / 1e9)
        return stage(name, seconds, flops / (peak * 1e9), gflop=flops / 1e9, **rate.fields("gflops"))

    llm_figures = {
        **llm_s.map(lambda s: 1000 * s / n_tokens).fields("ms_per_token"),
        "linear_layers_per_token": len(layers),
        "weight_mb_per_token": read_bytes / 1e6,
        **read_s.map(lambda s: read_bytes / s / 1e9).fields("read_gb_per_s"),
    }
    stages = {
        "llm": stage("llm", llm_s, read_s.median * n_tokens, **llm_figures),
        "flow": compute_stage("flow", flow_s, flow_flops),
        "hift": compute_stage("hift", hift_s, hift_flops),
    }
    rtf = paired(lambda *seconds: sum(seconds) / audio, llm_s, flow_s, hift_s)
    rtf_floor = sum(s["floor_seconds"] for s in stages.values()) / audio
    efficiency = rtf.map(lambda r: rtf_floor / r)
    bound = "a synthesis cannot run faster than the sum of its stages' floors"
    return {
        "model": model_name,
        "int8": int8,
        "threads": threads,
        "repeats": repeats,
        "warmup": warmup,
        "audio_seconds": audio,
        "speech_tokens": n_tokens,
        "gemm_gflops": gemm,
        "stages": stages,
        **rtf.fields("rtf"),
        "rtf_floor": rtf_floor,
        **failed.bounded_fields("efficiency", efficiency, 0.0, 1.0, bound),
        "efficiency_needed_for_rtf_3": rtf_floor / 3.0,
        "failed_measurements": failed.entries,
    }


def main() -> None:
    parser = bench_parser(__doc__, "roofline.json", 5.0, "audio length to generate")
    parser.add_argument("--int8", action="store_true", help="INT8 decoder LLM (the CPU configuration)")
    args = parser.parse_args()
    bench = BenchmarkRun("roofline", args.out)
    result = bench.finish(
        run(args.model, args.seconds, args.threads, args.int8, args.repeats, args.warmup, bench=bench)
    )
    print(json.dumps(result, indent=2))
    for entry in result["failed_measurements"]:
        print(f"failed measurement: {entry['name']} = {entry['value']} ({entry['why']})")


if __name__ == "__main__":
    main()
