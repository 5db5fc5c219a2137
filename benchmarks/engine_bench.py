"""Engine benchmark: real-size CosyVoice-300M architecture, dummy weights, fixed output length.

Times each stage of one synthesis (text encoding, LLM, flow, HiFT), gives the real-time factor,
the parameter bytes of the model in fp32 / fp16 / int8, and the peak RSS. Writes JSON.

    python -m benchmarks.engine_bench --out engine_bench.json [--model dummy] [--seconds 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from engine.loader import load_model
from engine.pipeline import SpeechDecoderStage, SynthesisRequest, TextEncoderStage
from engine.precision import parameter_bytes, quantize_linear_int8
from engine.sampling import SamplingOptions

TOKENS_PER_SECOND = 50  # v1 speech tokens per second of audio
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."


def timed(fn, *args) -> tuple:
    """(fn(*args), its wall-clock seconds)."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def fixed_length_request(text_tokens: int, audio_seconds: float, voice: str) -> SynthesisRequest:
    """A request whose speech length is forced (EOS masked until max_len): min ratio == max ratio."""
    ratio = audio_seconds * TOKENS_PER_SECOND / text_tokens
    sampling = SamplingOptions(min_token_text_ratio=ratio, max_token_text_ratio=ratio, seed=0)
    return SynthesisRequest(text=TEXT, voice=voice, sampling=sampling)


def model_bytes(model) -> dict[str, dict[str, int]]:
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


def int8_quality(model, segments) -> dict[str, float]:
    """INT8 (dynamic, Linear layers) against fp32: text-encoder cosine and greedy token agreement."""
    fp32_encoder = TextEncoderStage(model)
    int8_model = load_model(model.name, int8=True)
    int8_encoder, int8_decoder = TextEncoderStage(int8_model), SpeechDecoderStage(int8_model)
    request = fixed_length_request(
        len(model.frontend.tokenize(model.frontend.normalize(TEXT))), 1.0, model.voices.names[0]
    )
    a = fp32_encoder.encode(request)[0].text_encoded.ravel()
    b = int8_encoder.encode(request)[0].text_encoded.ravel()
    greedy = [replace(s, sampling=replace(s.sampling, greedy=True)) for s in segments]
    reference = SpeechDecoderStage(model).generate_tokens(greedy)[0]
    quantized = int8_decoder.generate_tokens(greedy)[0]
    return {
        "text_encoder_cosine": float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))),
        "greedy_token_agreement": float((reference == quantized).float().mean()),
        "greedy_tokens_compared": len(reference),
    }


def run(model_name: str, audio_seconds: float, threads: int) -> dict:
    torch.set_num_threads(threads)
    model = load_model(model_name)
    encoder, decoder = TextEncoderStage(model), SpeechDecoderStage(model)
    text_tokens = len(model.frontend.tokenize(model.frontend.normalize(TEXT)))
    request = fixed_length_request(text_tokens, audio_seconds, model.voices.names[0])

    segments, t_text = timed(encoder.encode, request)
    tokens, t_llm = timed(decoder.generate_tokens, segments)
    mels, t_flow = timed(decoder.tokens_to_mel, segments, tokens)
    waves, t_hift = timed(decoder.vocode, segments, mels)
    audio = sum(len(w) for w in waves) / model.config.sample_rate
    n_tokens = sum(len(t) for t in tokens)
    decode_time = t_llm + t_flow + t_hift
    return {
        "model": model_name,
        "threads": threads,
        "audio_seconds": audio,
        "speech_tokens": n_tokens,
        "seconds": {"text_encode": t_text, "llm": t_llm, "flow": t_flow, "hift": t_hift},
        "rtf": {
            "total": (t_text + decode_time) / audio,
            "decoder": decode_time / audio,
            "llm": t_llm / audio,
            "flow": t_flow / audio,
            "hift": t_hift / audio,
        },
        "llm_ms_per_token": 1000 * t_llm / n_tokens,
        "peak_rss_mb_during_synthesis": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        # weight surgery (casts, quantization) needs plain Linear weights, not the oneDNN-packed ones
        "parameter_bytes": model_bytes(load_model(model_name, cpu_packing=False)),
        "int8_vs_fp32": int8_quality(model, segments),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("engine_bench.json"))
    parser.add_argument("--model", default="dummy", help="preset (dummy = real-size CosyVoice-300M) or model dir")
    parser.add_argument("--seconds", type=float, default=5.0, help="audio length to generate")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    result = run(args.model, args.seconds, args.threads)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
