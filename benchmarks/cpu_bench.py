"""CPU precision per stage: each decoder stage in float32 against its reduced-precision variants, timed
side by side in one run and compared with float32 for quality; and what `dtype: auto` picks on this CPU
(`engine.nn.precision.cpu_auto_choice`), with its whole-decoder RTF.

    python -m benchmarks.cpu_bench --model dummy --out out/cpu_bench_v1.json [--seconds 5] [--threads 2]
        [--repeats 3] [--warmup 1] [--dtype auto] [--quality-only]

Variants: the LLM in float32, INT8, INT4 (`auto-int4`'s) and bfloat16; the flow and the vocoder in float32 and
bfloat16. Every variant is fed the float32 stage's input, so times and errors are the stage's own; each round times
every variant once in turn (load on a shared machine hits all alike). Quality against float32: the LLM's greedy
tokens and first-step probabilities, the mel's and waveform's cosine and max abs error, and the chosen flow + vocoder
together (`chain`). `--quality-only` skips the timing; `--skip llm:bfloat16 ...` leaves variants untimed. The default
run (`--model dummy`) takes about 3 minutes on the 2-core machine (Intel Xeon with AMX, 2026-12-07).
"""

from __future__ import annotations

import gc
import json
import platform
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.engine_bench import bench_parser, fixed_length_sampling, fixed_length_segments
from engine.llm.generation import TokenGenerator
from engine.loading.loader import LoadedModel, load_model
from engine.nn.precision import AUTO_INT4_DTYPE, cpu_capabilities, decoder_dtypes, module_sizes
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.segment import EncodedSegment
from serve_app.bench.progress import BenchmarkRun
from serve_app.bench.timing import Timing, paired

STAGE_VARIANTS = {
    "llm": ("float32", "int8", "int4", "bfloat16"),
    "flow": ("float32", "bfloat16"),
    "hift": ("float32", "bfloat16"),
}


def kit_segments(model: LoadedModel, model_dir: Path, audio_seconds: float) -> list[EncodedSegment]:
    """A conformance kit's first LLM case (its text token ids: the kit's tokenizer is not shipped) as one decoder
    segment in the kit's first voice, its speech forced to `audio_seconds`."""
    [case] = torch.load(model_dir.parent / "cases.pt", weights_only=True)["llm"][:1]
    text = torch.cat([case["prompt_text"], case["text"]], dim=1).long()
    with torch.inference_mode():
        encoded = model.text_llm.encode_text(text, torch.tensor([text.shape[1]]))[0]
    embedding = model.voices.embedding(model.voices.names[0]).float().numpy().ravel()
    text_len = case["text"].shape[1]
    return [
        EncodedSegment(
            text_encoded=encoded.float().numpy(),
            text_len=text_len,
            llm_embedding=embedding,
            flow_embedding=embedding,
            llm_prompt_speech_tokens=case["prompt_speech_token"][0].long().numpy(),
            flow_prompt_speech_tokens=np.zeros(0, dtype=np.int64),
            prompt_feat=np.zeros((0, model.config.mel_bins), dtype=np.float32),
            sampling=fixed_length_sampling(text_len, model.config.speech_tokens_for(audio_seconds)),
            speed=1.0,
        )
    ]


def _greedy(segments: list[EncodedSegment]) -> list[EncodedSegment]:
    return [replace(s, sampling=replace(s.sampling, greedy=True)) for s in segments]


def _flat(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.float().cpu().numpy()
    return np.asarray(x, dtype=np.float64).ravel()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    denominator = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / denominator) if denominator else float("nan")


def spectrum(wave: np.ndarray, n_fft: int = 1024, hop: int = 256) -> np.ndarray:
    """The STFT magnitude of a waveform (Hann window): what a listener hears, blind to a slow phase drift."""
    wave = torch.from_numpy(np.asarray(wave, dtype=np.float32))
    return torch.stft(wave, n_fft, hop, window=torch.hann_window(n_fft), return_complex=True).abs().numpy()


def compare(reference: Any, other: Any, waveform: bool = False) -> dict[str, float]:
    """Cosine and max abs error of `other` against `reference` (tensors or arrays of one shape); for a waveform also
    the cosine of their STFT magnitudes (`spectral_cosine`) and the signal-to-error ratio in dB."""
    a, b = _flat(reference), _flat(other)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} and {b.shape}")
    result = {
        "cosine": cosine(a, b),
        "max_abs_error": float(np.abs(a - b).max()),
        "reference_max_abs": float(np.abs(a).max()),
    }
    if waveform:
        error = float(np.sum((a - b) ** 2))
        result["snr_db"] = float(10 * np.log10(np.sum(a**2) / error)) if error else float("inf")
        result["spectral_cosine"] = cosine(
            spectrum(a).ravel().astype(np.float64), spectrum(b).ravel().astype(np.float64)
        )
    return result


def load_variants(model_name: str) -> tuple[LoadedModel, dict[str, SpeechDecoderStage]]:
    """The float32 model (encoder and decoder), and a decoder per variant name: float32, bfloat16 (every module),
    int8 and int4 (their LLM only: the float32 flow and vocoder are not held again)."""
    fp32 = load_model(model_name, dtype="float32")
    variants = {
        "float32": fp32,
        "bfloat16": load_model(model_name, dtype="bfloat16", components=("decoder",)),
        "int8": load_model(model_name, dtype="float32", int8=True, components=("decoder",)),
        "int4": load_model(model_name, dtype=AUTO_INT4_DTYPE, components=("decoder",)),
    }
    for name in ("int8", "int4"):
        variants[name].flow, variants[name].hift = fp32.flow, fp32.hift
    gc.collect()
    return fp32, {name: SpeechDecoderStage(model) for name, model in variants.items()}


def stage_calls(
    stages: dict[str, SpeechDecoderStage], segments, tokens, mel, skip: tuple[str, ...] = ()
) -> dict[str, dict[str, Any]]:
    """stage -> variant -> the zero-argument call that runs that stage of that variant on float32 inputs (less the
    'stage:variant' entries of `skip`)."""
    calls = {
        "llm": {v: partial(stages[v].generate_tokens, segments) for v in STAGE_VARIANTS["llm"]},
        "flow": {v: partial(stages[v].tokens_to_mel, segments, tokens) for v in STAGE_VARIANTS["flow"]},
        "hift": {v: partial(stages[v].vocode, segments, mel) for v in STAGE_VARIANTS["hift"]},
    }
    return {
        stage: {v: call for v, call in per_variant.items() if f"{stage}:{v}" not in skip}
        for stage, per_variant in calls.items()
    }


def alternated(calls: dict[str, Any], repeats: int, warmup: int, bench: BenchmarkRun, label: str) -> dict[str, Timing]:
    """Each call's seconds over `repeats` rounds that run every call once in turn, after `warmup` rounds (each round
    a step of `bench`, labelled `label`)."""
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(warmup + repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            if round_ >= warmup:
                seconds[name].append(time.perf_counter() - started)
        bench.step(f"{label} round {round_ + 1}/{warmup + repeats}")
    return {name: Timing(tuple(s)) for name, s in seconds.items()}


def first_step_probabilities(stage: SpeechDecoderStage, segment: EncodedSegment) -> torch.Tensor:
    """The probabilities the LLM gives its first speech token after the prefill (greedy: the same prefix for every
    variant, so they compare however the later tokens diverge)."""
    generator = TokenGenerator(stage.model.llm)
    generator.add(stage.generation_requests(_greedy([segment]))[0])
    [event] = generator.step()
    return event.logprobs.float().exp()


def quality(stages: dict[str, SpeechDecoderStage], segments, mel_fp32, wave_fp32, tokens_fp32) -> dict[str, Any]:
    """Every reduced-precision variant against float32, stage by stage, on float32 inputs."""
    greedy = _greedy(segments)
    reference_tokens = stages["float32"].generate_tokens(greedy)[0]
    result: dict[str, Any] = {"llm": {}, "flow": {}, "hift": {}}
    reference_probabilities = first_step_probabilities(stages["float32"], segments[0])
    for variant in STAGE_VARIANTS["llm"][1:]:
        tokens = stages[variant].generate_tokens(greedy)[0]
        probabilities = first_step_probabilities(stages[variant], segments[0])
        result["llm"][variant] = {
            "greedy_token_agreement": float((tokens == reference_tokens).float().mean()),
            "greedy_tokens_compared": len(reference_tokens),
            "first_step_same_top1": bool(probabilities.argmax() == reference_probabilities.argmax()),
            "first_step_probabilities": compare(reference_probabilities, probabilities),
        }
    for variant in STAGE_VARIANTS["flow"][1:]:
        result["flow"][variant] = compare(mel_fp32[0], stages[variant].tokens_to_mel(segments, tokens_fp32)[0])
    for variant in STAGE_VARIANTS["hift"][1:]:
        result["hift"][variant] = compare(wave_fp32[0], stages[variant].vocode(segments, mel_fp32)[0], waveform=True)
    # the vocoder's own sensitivity: float32 throughout, its input mel only rounded to bfloat16 (random weights
    # make it chaotic: this alone moves the waveform about as far as bfloat16 weights do)
    rounded = [mel.to(torch.bfloat16).float() for mel in mel_fp32]
    result["hift"]["float32_on_rounded_mel"] = compare(
        wave_fp32[0], stages["float32"].vocode(segments, rounded)[0], waveform=True
    )
    return result


def chain_quality(stages, choice: dict[str, str], segments, tokens_fp32, wave_fp32) -> dict[str, float]:
    """The chosen flow then the chosen vocoder from the float32 tokens, against the float32 waveform. (The chosen
    LLM's own tokens are compared in `llm`: with other tokens the waveforms are not comparable sample by sample.)"""
    mel = stages[choice["flow"]].tokens_to_mel(segments, tokens_fp32)
    return compare(wave_fp32[0], stages[choice["hift"]].vocode(segments, mel)[0], waveform=True)


def speedup_fields(timings: dict[str, Timing], baseline: str, suffix: str) -> dict[str, Any]:
    """Each variant's timing fields (`Timing.fields`) and, for every variant but `baseline`, `<variant><suffix>`:
    the baseline's median over its own."""
    fields: dict[str, Any] = {}
    for variant, timing in timings.items():
        fields |= timing.fields(variant)
        if variant != baseline:
            fields[f"{variant}{suffix}"] = timings[baseline].median / timing.median
    return fields


def report_settings(
    model_name: str, threads: int, repeats: int, warmup: int, dtype: str, choice: dict[str, str], reason: str
) -> dict[str, Any]:
    """The fields a CPU precision report opens with: the model, this CPU and torch, the run's settings and the choice
    timed beside float32 (cpu_bench, official_bench)."""
    caps = cpu_capabilities()
    return {
        "model": model_name,
        "cpu": {"model": caps.model, "flags": sorted(caps.flags), "torch_capability": caps.torch_capability},
        "torch": torch.__version__,
        "threads": threads,
        "repeats": repeats,
        "warmup": warmup,
        "dtype": dtype,
        "choice": choice,
        "choice_reason": reason,
    }


def choice_for(dtype: str, model: LoadedModel) -> tuple[dict[str, str], str]:
    """stage -> variant name of `dtype` ('auto', 'auto-int4': this CPU's pick for this model), and why."""
    sizes = module_sizes(model.llm, model.flow, model.hift)
    picked = decoder_dtypes(dtype, model.config.family.prefers_bfloat16, torch.device("cpu"), sizes)
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    llm = picked.llm_quantization or names[picked.llm]
    return {"llm": llm, "flow": names[picked.flow], "hift": names[picked.hift]}, picked.reason


def run(
    model_name: str,
    audio_seconds: float,
    threads: int,
    repeats: int,
    warmup: int,
    dtype: str = "auto",
    quality_only: bool = False,
    skip: tuple[str, ...] = (),
    bench: BenchmarkRun | None = None,
) -> dict[str, Any]:
    """The report (see the module docstring); the quality figures and each stage's timed samples go into `bench`'s
    report as they are taken."""
    bench = bench or BenchmarkRun("cpu_bench")
    bench.plan(1 + (0 if quality_only else len(STAGE_VARIANTS) * (warmup + repeats)))  # quality, then the rounds
    torch.set_num_threads(threads)
    fp32, stages = load_variants(model_name)
    kit = Path(model_name) / ".." / "cases.pt"
    if kit.is_file():
        segments = kit_segments(fp32, Path(model_name), audio_seconds)
    else:
        segments = fixed_length_segments(TextEncoderStage(fp32), audio_seconds)
    choice, reason = choice_for(dtype, fp32)
    result = report_settings(model_name, threads, repeats, warmup, dtype, choice, reason)
    result |= {"family": fp32.config.family.name, "machine": platform.machine()}
    with torch.inference_mode():
        reference = stages["float32"]
        tokens = reference.generate_tokens(segments)
        mel = reference.tokens_to_mel(segments, tokens)
        wave = reference.vocode(segments, mel)
        audio = sum(len(w) for w in wave) / fp32.config.sample_rate
        result |= {"audio_seconds": audio, "speech_tokens": sum(len(t) for t in tokens)}
        result["quality"] = quality(stages, segments, mel, wave, tokens)
        result["quality"]["chain"] = chain_quality(stages, choice, segments, tokens, wave)
        bench.step("quality", **result)
        if quality_only:
            return result
        timings = {}
        for stage, calls in stage_calls(stages, segments, tokens, mel, skip).items():
            timings[stage] = alternated(calls, repeats, warmup, bench, stage)
            samples = {variant: list(seconds.samples) for variant, seconds in timings[stage].items()}
            bench.record(seconds_samples={stage: samples})
    rtf: dict[str, Any] = {
        stage: speedup_fields({v: t.map(lambda s: s / audio) for v, t in per_variant.items()}, "float32", "_speedup")
        for stage, per_variant in timings.items()
    }
    decoder = {
        name: paired(lambda *s: sum(s) / audio, *(timings[stage][pick[stage]] for stage in ("llm", "flow", "hift")))
        for name, pick in (("float32", {s: "float32" for s in timings}), ("choice", choice))
    }
    rtf["decoder"] = speedup_fields(decoder, "float32", "_speedup")
    n_tokens = result["speech_tokens"]
    result["llm_ms_per_token"] = {
        variant: 1000 * seconds.median / n_tokens for variant, seconds in timings["llm"].items()
    }
    result["rtf"] = rtf
    result["seconds_samples"] = {
        stage: {variant: list(seconds.samples) for variant, seconds in per_variant.items()}
        for stage, per_variant in timings.items()
    }
    return result


def main() -> None:
    parser = bench_parser(__doc__, "cpu_bench.json", 5.0, "audio length to generate")
    parser.add_argument("--dtype", default="auto", help="the choice set beside float32: auto, auto-int4 or a dtype")
    parser.add_argument("--quality-only", action="store_true", help="skip the timing")
    parser.add_argument(
        "--skip", nargs="*", default=(), help="stage:variant entries not to time (e.g. llm:bfloat16); quality stays"
    )
    args = parser.parse_args()
    bench = BenchmarkRun("cpu_bench", args.out)
    result = run(
        args.model,
        args.seconds,
        args.threads,
        args.repeats,
        args.warmup,
        args.dtype,
        args.quality_only,
        tuple(args.skip),
        bench,
    )
    bench.finish(result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
