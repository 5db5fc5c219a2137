"""Engine benchmark: a real-size architecture with dummy weights (any family), fixed output length.

Times each stage of one synthesis (text encoding, LLM, flow, HiFT; each the median of `--repeats` timed runs after
`--warmup` untimed ones, with its spread: `serve_app.bench.timing`), gives the real-time factor, the peak RSS, the
parameter bytes of the model in fp32 / fp16 / int8, and how far INT8 moves the text encoder and the greedy tokens.
Writes JSON.

    python -m benchmarks.engine_bench --out engine_bench.json [--model dummy] [--seconds 5] [--repeats 3] [--warmup 1]

The speech length is forced (every stop id masked until max_len, min ratio == max ratio), in speech tokens of the
model's own rate (flow mel frames per token x vocoder samples per frame), so every family speaks `--seconds`.
The default run takes about 2 minutes on the 2-core machine (Intel Xeon with AMX, 2026-12-07).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import resource
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch.ao.nn.quantized import dynamic as quantized_dynamic

from engine.llm.sampling import SamplingOptions
from engine.loading.loader import LoadedModel, load_model
from engine.nn.precision import parameter_bytes, quantize_linear_int8
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import SynthesisRequest
from serve_app.bench.progress import BenchmarkRun
from serve_app.bench.timing import DEFAULT_REPEATS, DEFAULT_WARMUP, add_repeat_options, measure, paired

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."


def fixed_length_sampling(text_tokens: int, speech_tokens: int) -> SamplingOptions:
    """Sampling that speaks exactly `speech_tokens` tokens for `text_tokens` target text tokens: min ratio == max
    ratio (half a token over, so that the float product cannot round below), every stop id masked until then."""
    ratio = (speech_tokens + 0.5) / text_tokens
    return SamplingOptions(
        min_token_text_ratio=ratio, max_token_text_ratio=ratio, mask_all_stop_ids_before_min_len=True, seed=0
    )


def benchmark_voice(model: LoadedModel) -> str:
    """The built-in speaker the benchmarks speak in (every preset has two); SystemExit for a model without one."""
    if not model.voices.names:
        raise SystemExit(f"model {model.name} has no built-in speaker (spk2info.pt); the benchmarks need one")
    return model.voices.names[0]


def fixed_length_text_request(encoder: TextEncoderStage, audio_seconds: float) -> SynthesisRequest:
    """TEXT in the model's first built-in voice, its speech forced to `audio_seconds`.

    The engine writes the LLM prompt (CosyVoice3: its system prompt and `<|endofprompt|>`); the target text length
    that sets the speech length is the one the engine gives the LLM.
    """
    voice = benchmark_voice(encoder.model)
    [text] = encoder.segment_texts(SynthesisRequest(text=TEXT, voice=voice))  # TEXT is one sentence
    sampling = fixed_length_sampling(len(text.text), encoder.model.config.speech_tokens_for(audio_seconds))
    return SynthesisRequest(text=TEXT, voice=voice, sampling=sampling)


def fixed_length_segments(encoder: TextEncoderStage, audio_seconds: float, count: int = 1) -> list[EncodedSegment]:
    """`count` copies of the one segment of `fixed_length_text_request`."""
    [segment] = encoder.encode(fixed_length_text_request(encoder, audio_seconds))
    return [segment] * count


def model_bytes(model: LoadedModel) -> dict[str, dict[str, int]]:
    """Measured bytes of each module's weights after a real cast / quantization (not computed)."""
    modules = {"llm": model.llm, "flow": model.flow, "hift": model.hift}
    result = {}
    for name, module in modules.items():
        result[name] = {
            "fp32": parameter_bytes(module),
            "fp16": parameter_bytes(copy.deepcopy(module).half()),
            "int8_linear": parameter_bytes(quantize_linear_int8(copy.deepcopy(module))),
        }
    result["total"] = {k: sum(v[k] for v in result.values()) for k in ("fp32", "fp16", "int8_linear")}
    return result


def _greedy(segments: list[EncodedSegment]) -> list[EncodedSegment]:
    return [replace(s, sampling=replace(s.sampling, greedy=True)) for s in segments]


def int8_quality(model_name: str, request: SynthesisRequest, reference: EncodedSegment, reference_tokens) -> dict:
    """INT8 (dynamic, Linear layers: `load_model(int8=True)`) against float32: the cosine of the text encoder's output
    for `request` to the float32 one in `reference` (None where the text module has no Linear layer to quantize, as
    the v2/v3 embedding lookup), and the fraction of the float32 greedy LLM tokens `reference_tokens` of
    `reference` that the INT8 LLM reproduces."""
    model = load_model(model_name, int8=True)
    quantized_layers = sum(isinstance(m, quantized_dynamic.Linear) for m in model.text_llm.modules())
    cosine = None
    if quantized_layers:
        [encoded] = TextEncoderStage(model).encode(request)
        a, b = reference.text_encoded.ravel(), encoded.text_encoded.ravel()
        cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    quantized = SpeechDecoderStage(model).generate_tokens(_greedy([reference]))[0]
    return {
        "text_encoder_int8_linear_layers": quantized_layers,
        "text_encoder_cosine": cosine,
        "greedy_token_agreement": float((reference_tokens == quantized).float().mean()),
        "greedy_tokens_compared": len(reference_tokens),
    }


def run(
    model_name: str,
    audio_seconds: float,
    threads: int,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    bench: BenchmarkRun | None = None,
) -> dict:
    """Time one fixed-length synthesis stage by stage (each stage after `warmup` untimed calls, `repeats` times:
    the median and spread); then, one model in memory at a time (a real-size CosyVoice3 takes 5 GB), the INT8
    quality and the parameter bytes. Each stage's seconds go into `bench`'s report as they are taken."""
    bench = bench or BenchmarkRun("engine_bench")
    bench.plan(6)  # four stages, INT8 quality, parameter bytes
    torch.set_num_threads(threads)
    model = load_model(model_name)
    encoder, decoder = TextEncoderStage(model), SpeechDecoderStage(model)
    request = fixed_length_text_request(encoder, audio_seconds)

    segments, t_text = measure(partial(encoder.encode, request), repeats, warmup)
    bench.step("text_encode", seconds=t_text.fields("text_encode"))
    tokens, t_llm = measure(partial(decoder.generate_tokens, segments), repeats, warmup)
    bench.step("llm", seconds=t_llm.fields("llm"))
    mels, t_flow = measure(partial(decoder.tokens_to_mel, segments, tokens), repeats, warmup)
    bench.step("flow", seconds=t_flow.fields("flow"))
    waves, t_hift = measure(partial(decoder.vocode, segments, mels), repeats, warmup)
    bench.step("hift", seconds=t_hift.fields("hift"))
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    audio = sum(len(w) for w in waves) / model.config.sample_rate
    n_tokens = sum(len(t) for t in tokens)
    stages = {"text_encode": t_text, "llm": t_llm, "flow": t_flow, "hift": t_hift}
    # each repeat's stages added up, so that the total's spread is that of whole syntheses
    stages_rtf = {"total": paired(lambda *seconds: sum(seconds) / audio, *stages.values())}
    stages_rtf["decoder"] = paired(lambda *seconds: sum(seconds) / audio, t_llm, t_flow, t_hift)
    stages_rtf |= {name: stages[name].map(lambda s: s / audio) for name in ("llm", "flow", "hift")}
    result = {
        "model": model_name,
        "family": model.config.family.name,
        "threads": threads,
        "repeats": repeats,
        "warmup": warmup,
        "audio_seconds": audio,
        "speech_tokens": n_tokens,
        "seconds": {k: v for name, timing in stages.items() for k, v in timing.fields(name).items()},
        "rtf": {k: v for name, timing in stages_rtf.items() for k, v in timing.fields(name).items()},
        **t_llm.map(lambda s: 1000 * s / n_tokens).fields("llm_ms_per_token"),
        "peak_rss_mb_during_synthesis": peak_rss_mb,  # the process's peak so far: load and the timed syntheses
    }
    reference_tokens = decoder.generate_tokens(_greedy(segments))[0]
    del model, encoder, decoder, tokens, mels, waves
    gc.collect()
    bench.record(**result)
    result["int8_vs_fp32"] = int8_quality(model_name, request, segments[0], reference_tokens)
    bench.step("int8 quality", int8_vs_fp32=result["int8_vs_fp32"])
    gc.collect()
    # weight surgery (casts, quantization) needs plain Linear weights, not the oneDNN-packed ones
    result["parameter_bytes"] = model_bytes(load_model(model_name, cpu_packing=False))
    bench.step("parameter bytes", parameter_bytes=result["parameter_bytes"])
    return result


def bench_parser(doc: str, out: str, seconds: float, seconds_help: str) -> argparse.ArgumentParser:
    """A benchmark's command line with the options the engine benchmarks share: --out, --model, --seconds,
    --threads, --repeats, --warmup."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument(
        "--model", default="dummy", help="preset (dummy = real-size CosyVoice-300M, cosyvoice3-0.5b, ...) or model dir"
    )
    parser.add_argument("--seconds", type=float, default=seconds, help=seconds_help)
    parser.add_argument("--threads", type=int, default=2)
    add_repeat_options(parser)
    return parser


def main() -> None:
    args = bench_parser(__doc__, "engine_bench.json", 5.0, "audio length to generate").parse_args()
    bench = BenchmarkRun("engine_bench", args.out)
    result = bench.finish(run(args.model, args.seconds, args.threads, args.repeats, args.warmup, bench))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
