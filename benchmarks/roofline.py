"""How close one batch-1 synthesis runs to this machine's limits, stage by stage (the issue-3 RTF question).

- Machine: the best GEMM rate over a few shapes (the compute ceiling: convolutions and attention lower to GEMMs).
- Flow and HiFT: their FLOPs, counted by torch's FlopCounterMode over the real stage call (plus the fused CPU
  attention kernel, which the counter does not know), divided by that ceiling: the stage's time at 100% of peak.
- LLM: at batch 1 each decode step reads every weight of the Linear layers it runs once, so its floor is the
  time of exactly those layers (found with forward hooks on a real step) run alone on one row, back to back.

    python -m benchmarks.roofline --out out/roofline.json [--model dummy] [--seconds 5] [--int8]

`rtf_floor` adds the three floors; `efficiency_needed_for_rtf_3` is the fraction of that ideal the whole
decoder must reach for RTF 3.0 (above 1: out of reach on this machine whatever the code).
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.nn.quantized import dynamic as quantized_dynamic
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from benchmarks.engine_bench import bench_parser, fixed_length_segments, timed, write_json
from engine.layers import PackedLinear
from engine.llm import TokenGenerator
from engine.loader import load_model
from engine.pipeline import SpeechDecoderStage, TextEncoderStage
from engine.precision import parameter_bytes

GEMM_SHAPES = ((860, 256, 1024), (860, 1024, 256), (1024, 1024, 1024), (2048, 2048, 2048))  # (M, K, N)
_LINEAR_TYPES = (nn.Linear, PackedLinear, quantized_dynamic.Linear)


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


def _best_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def peak_gemm_gflops(seconds_per_shape: float = 1.0) -> dict[str, float]:
    """Sustained float32 GEMM rate per shape 'MxKxN' (GFLOPS, averaged over about a second, as long as a stage
    runs: short bursts run at a higher clock) and the best of them as 'peak'."""
    rates = {}
    for m, k, n in GEMM_SHAPES:
        a, w = torch.randn(m, k), torch.randn(n, k)
        F.linear(a, w)
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds_per_shape:
            F.linear(a, w)
            calls += 1
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n * calls / elapsed / 1e9
    return {**rates, "peak": max(rates.values())}


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


def linear_read_seconds(layers: list[nn.Module]) -> float:
    """One row through every layer in turn: the weight-read time of a batch-1 decode step."""
    rows = [torch.randn(1, layer.in_features) for layer in layers]

    def run() -> None:
        for layer, row in zip(layers, rows, strict=True):
            layer(row)

    with torch.inference_mode():
        return _best_seconds(run, repeats=20)


def run(model_name: str, audio_seconds: float, threads: int, int8: bool) -> dict:
    torch.set_num_threads(threads)
    model = load_model(model_name, int8=int8)
    decoder = SpeechDecoderStage(model)
    segments = fixed_length_segments(TextEncoderStage(model), audio_seconds)

    with torch.inference_mode():
        tokens, llm_s = timed(decoder.generate_tokens, segments)
        decoder.tokens_to_mel(segments, tokens)  # warm-up: the first flow and HiFT calls set up their kernels
        mels, flow_s = timed(decoder.tokens_to_mel, segments, tokens)
        decoder.vocode(segments, mels)
        waves, hift_s = timed(decoder.vocode, segments, mels)
        flow_flops = counted_flops(decoder.tokens_to_mel, segments, tokens)
        hift_flops = counted_flops(decoder.vocode, segments, mels)
    audio = sum(len(w) for w in waves) / model.config.sample_rate
    n_tokens = sum(len(t) for t in tokens)

    peak = peak_gemm_gflops()
    layers = per_token_linears(model.llm, decoder.generation_requests(segments)[0])
    read_s = linear_read_seconds(layers)
    read_bytes = sum(parameter_bytes(layer) for layer in layers)

    def compute_stage(seconds: float, flops: int) -> dict:
        floor = flops / (peak["peak"] * 1e9)
        return {"seconds": seconds, "gflop": flops / 1e9, "gflops": flops / seconds / 1e9, "floor_seconds": floor}

    stages = {
        "llm": {
            "seconds": llm_s,
            "ms_per_token": 1000 * llm_s / n_tokens,
            "linear_layers_per_token": len(layers),
            "weight_mb_per_token": read_bytes / 1e6,
            "read_gb_per_s": read_bytes / read_s / 1e9,
            "floor_seconds": read_s * n_tokens,
        },
        "flow": compute_stage(flow_s, flow_flops),
        "hift": compute_stage(hift_s, hift_flops),
    }
    rtf = sum(s["seconds"] for s in stages.values()) / audio
    rtf_floor = sum(s["floor_seconds"] for s in stages.values()) / audio
    return {
        "model": model_name,
        "int8": int8,
        "threads": threads,
        "audio_seconds": audio,
        "speech_tokens": n_tokens,
        "gemm_gflops": peak,
        "stages": stages,
        "rtf": rtf,
        "rtf_floor": rtf_floor,
        "efficiency": rtf_floor / rtf,
        "efficiency_needed_for_rtf_3": rtf_floor / 3.0,
    }


def main() -> None:
    parser = bench_parser(__doc__, "roofline.json", 5.0, "audio length to generate")
    parser.add_argument("--int8", action="store_true", help="INT8 decoder LLM (the CPU configuration)")
    args = parser.parse_args()
    result = run(args.model, args.seconds, args.threads, args.int8)
    write_json(result, args.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
