"""Bi-streaming benchmark: the first audio of text that arrives as it is written, against the same text sent whole.

    python -m benchmarks.bistream_bench --model cosyvoice3-0.5b --out out/bistream_v3.json [--tokens-per-second 20]
        [--prompt-seconds 10] [--repeats 3] [--warmup 1] [--threads 2] [--concurrent 3] [--parts first-audio lm-steps]

Two runs on the same decoder, alternating (order swapped every pair, so load on a shared machine hits both alike):
bi-streamed, the text's ids arriving one every 1 / `--tokens-per-second` s and pushed to the LM as they come
(`BistreamSynthesis.push_text`), the utterance prepared before t = 0 as a WebSocket `start` does; and whole, the text
encoded at t = 0 and its first sentence streamed, as `/v1/audio/speech` streams a text. Each is timed to its first
non-empty audio chunk; `bistream_first_audio_ratio` is bi-streamed / whole, pair by pair. Then `--concurrent`
utterances' LMs decode the text's first sentence (given 5 ids whenever one waits for text) to their ends, alternating:
stepped together (`step_together`, one batched forward a step, as a replica's loop steps them) and one after another
(each alone, as the loop did before); `lm_steps_speedup` is one after another / together, pair by pair (at most
`--concurrent`).
`--prompt-seconds` > 0 speaks in a voice cloned from a synthetic prompt that long, else in the first built-in voice;
`--parts` runs one of the two measurements only. On CosyVoice3 at its real size the lm-steps part took 581 s on the
2-core machine (AMD EPYC, 2026-12-07, shared with other work); the first-audio part about 1 minute on a quiet one
(Intel Xeon with AMX, 2026-12-07): the default run ends within 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.batching_bench import synthetic_prompt
from engine.llm.bistream import BistreamDecoder, step_together
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import load_model
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.cloning import VoicePrompt
from serve_app.bench.progress import BenchmarkRun
from serve_app.bench.timing import (
    BATCH_RATIO_BOUND,
    FailedMeasurements,
    Timing,
    add_repeat_options,
    paired,
    ratio,
)

TEXT = (
    "Thanks for calling, I can help you move your appointment to a later time this week. "
    "There are openings on Thursday morning and on Friday afternoon. "
    "Which one would suit you better?"
)
FIRST_SENTENCE = TEXT.split(". ")[0] + "."  # the LM steps' part: a real-size LM takes ~0.5 s a step on 2 cores
# both runs speak 2 to 3 speech tokens per text token, never stopping before 2 (a dummy LM may stop at once)
SAMPLING = SamplingOptions(
    seed=11, min_token_text_ratio=2.0, max_token_text_ratio=3.0, mask_all_stop_ids_before_min_len=True
)


def first_audio_bistream(
    encoder: TextEncoderStage,
    decoder: SpeechDecoderStage,
    request: SynthesisRequest,
    prompt: VoicePrompt | None,
    tokens_per_second: float,
) -> dict[str, float]:
    """Seconds from the first text token's arrival to the first audio chunk, and the text tokens arrived then."""
    ids = encoder.text_piece_tokens(TEXT)
    synthesis = decoder.open_bistream(encoder.bistream_start(request, prompt))
    start = time.perf_counter()
    pushed = 0
    while pushed < len(ids):
        arrived = min(len(ids), int((time.perf_counter() - start) * tokens_per_second) + 1)
        if arrived == pushed:
            time.sleep(max(0.0, arrived / tokens_per_second - (time.perf_counter() - start)))  # the next one's time
            continue
        chunks = synthesis.push_text(ids[pushed:arrived])
        pushed = arrived
        if chunks:
            return {"seconds": time.perf_counter() - start, "text_tokens": pushed}
    for _ in synthesis.finish():
        return {"seconds": time.perf_counter() - start, "text_tokens": pushed}
    raise SystemExit("the bi-streamed utterance ended without audio")


def first_audio_whole(
    encoder: TextEncoderStage, decoder: SpeechDecoderStage, request: SynthesisRequest, prompt: VoicePrompt | None
) -> float:
    """Seconds from the whole text to the first audio chunk of its first sentence, streamed."""
    start = time.perf_counter()
    first = encoder.encode(request, prompt)[0]
    for outputs in decoder.open_stream([first]):
        if outputs[0] is None:
            break
        if len(outputs[0]):
            return time.perf_counter() - start
    raise SystemExit("the first sentence ended without audio")


def measure_bistream(
    encoder: TextEncoderStage,
    decoder: SpeechDecoderStage,
    prompt: VoicePrompt | None,
    tokens_per_second: float,
    repeats: int,
    warmup: int,
    bench: BenchmarkRun | None = None,
) -> dict[str, Any]:
    """The two runs alternating (see the module): medians, spreads and the pair-by-pair ratio; each pair's seconds go
    into `bench`'s report (`bistream.seconds_samples`) as it ends."""
    bench = bench or BenchmarkRun("bistream")
    bench.plan(warmup + repeats)
    voice = "voice_benchmark" if prompt is not None else encoder.voices[0]
    request = SynthesisRequest(text=TEXT, voice=voice, sampling=SAMPLING)
    times: dict[str, list[float]] = {"bistream": [], "whole": []}
    arrived: list[int] = []
    for index in range(warmup + repeats):
        for mode in ("bistream", "whole") if index % 2 == 0 else ("whole", "bistream"):
            if mode == "bistream":
                run = first_audio_bistream(encoder, decoder, request, prompt, tokens_per_second)
                seconds = run["seconds"]
                if index >= warmup:
                    arrived.append(run["text_tokens"])
            else:
                seconds = first_audio_whole(encoder, decoder, request, prompt)
            if index >= warmup:
                times[mode].append(seconds)
        bench.step(f"pair {index + 1}/{warmup + repeats}", bistream={"seconds_samples": times})
    bistream, whole = Timing(tuple(times["bistream"])), Timing(tuple(times["whole"]))
    return {
        **bistream.fields("bistream_first_audio_s"),
        **whole.fields("whole_first_audio_s"),
        **paired(ratio, bistream, whole).fields("ratio"),
        "text_tokens": len(encoder.text_piece_tokens(TEXT)),
        "first_sentence_text_tokens": len(encoder.segment_texts(request, prompt)[0].text),
        "text_tokens_arrived_at_first_audio": arrived,
        "prompt_speech_tokens": 0 if prompt is None else len(prompt.speech_tokens),
        "seconds_samples": times,
    }


PARTS = ("first-audio", "lm-steps")
TEXT_GROUP = 5  # text ids an LM waiting for text is given at once: the families' mix ratio's text group


def decode_utterances(decoders: list[BistreamDecoder], ids: list[int], together: bool) -> list[list[int]]:
    """Decode each utterance's LM to its end on `ids` -> each one's speech tokens. `together`: every step steps all
    those decoding in one `step_together`; else each decodes alone, one after another."""
    spoken: list[list[int]] = [[] for _ in decoders]
    given = [0] * len(decoders)

    def feed(index: int) -> None:
        decoder = decoders[index]
        while not decoder.decoding and not decoder.finished:
            if given[index] >= len(ids):
                decoder.end_text()
            else:
                decoder.add_text(torch.tensor(ids[given[index] : given[index] + TEXT_GROUP]))
                given[index] += TEXT_GROUP

    if not together:
        for index, decoder in enumerate(decoders):
            feed(index)
            while decoder.decoding:
                token = decoder.step()
                spoken[index] += [] if token is None else [token]
                feed(index)
        return spoken
    while True:
        for index in range(len(decoders)):
            feed(index)
        decoding = [index for index, decoder in enumerate(decoders) if decoder.decoding]
        if not decoding:
            return spoken
        for index, outcome in zip(decoding, step_together([decoders[i] for i in decoding]), strict=True):
            if isinstance(outcome, Exception):
                raise outcome
            spoken[index] += [] if outcome is None else [outcome]


def measure_lm_steps(
    encoder: TextEncoderStage,
    decoder: SpeechDecoderStage,
    prompt: VoicePrompt | None,
    concurrent: int,
    repeats: int,
    warmup: int,
    bench: BenchmarkRun,
) -> dict[str, Any]:
    """`concurrent` utterances decoded together and one after another, alternating (see the module); both ways must
    decode the same tokens."""
    bench.plan(warmup + repeats)
    voice = "voice_benchmark" if prompt is not None else encoder.voices[0]
    ids = encoder.text_piece_tokens(FIRST_SENTENCE)
    times: dict[str, list[float]] = {"together": [], "one_by_one": []}
    spoken: dict[bool, list[list[int]]] = {}
    for index in range(warmup + repeats):
        for together in (True, False) if index % 2 == 0 else (False, True):
            decoders = []
            for seed in range(concurrent):
                sampling = SamplingOptions(**{**SAMPLING.__dict__, "seed": seed})
                start = encoder.bistream_start(SynthesisRequest(text="", voice=voice, sampling=sampling), prompt)
                decoders.append(decoder.open_bistream(start).llm)
            started = time.perf_counter()
            spoken[together] = decode_utterances(decoders, ids, together)
            if index >= warmup:
                times["together" if together else "one_by_one"].append(time.perf_counter() - started)
        if spoken[True] != spoken[False]:
            raise SystemExit("the utterances decoded together spoke other tokens than one after another")
        bench.step(f"lm pair {index + 1}/{warmup + repeats}", lm_steps={"seconds_samples": times})
    together, one_by_one = Timing(tuple(times["together"])), Timing(tuple(times["one_by_one"]))
    return {
        "concurrent": concurrent,
        **together.fields("together_s"),
        **one_by_one.fields("one_by_one_s"),
        **paired(ratio, one_by_one, together).fields("speedup"),
        "speech_tokens": [len(tokens) for tokens in spoken[True]],
        "seconds_samples": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bistream_bench.json"))
    parser.add_argument("--model", default="cosyvoice3-0.5b", help="a CosyVoice2/3 preset or model dir")
    parser.add_argument("--threads", type=int, default=2)
    add_repeat_options(parser)
    parser.add_argument("--tokens-per-second", type=float, default=20.0, help="how fast the text arrives")
    parser.add_argument("--prompt-seconds", type=float, default=0.0, help="a cloned voice's prompt (0: a speaker)")
    parser.add_argument("--concurrent", type=int, default=3, help="utterances whose LM steps are batched")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS, help="which measurements to run")
    args = parser.parse_args()
    bench = BenchmarkRun("bistream", args.out)
    bench.record(
        model=args.model,
        threads=args.threads,
        tokens_per_second=args.tokens_per_second,
        prompt_seconds=args.prompt_seconds,
        repeats=args.repeats,
        warmup=args.warmup,
        text=TEXT,
    )
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    encoder, decoder = TextEncoderStage(model), SpeechDecoderStage(model)
    prompt = synthetic_prompt(encoder, args.prompt_seconds) if args.prompt_seconds > 0 else None
    failed = FailedMeasurements()
    report: dict[str, Any] = {}
    if "first-audio" in args.parts:
        timing = measure_bistream(encoder, decoder, prompt, args.tokens_per_second, args.repeats, args.warmup, bench)
        report |= {
            "bistream": timing,
            "bistream_first_audio_ratio": timing["ratio"],
            "bistream_first_audio_ratio_spread": timing["ratio_spread"],
        }
    if "lm-steps" in args.parts:
        lm_steps = measure_lm_steps(encoder, decoder, prompt, args.concurrent, args.repeats, args.warmup, bench)
        speedup = paired(
            ratio,
            Timing(tuple(lm_steps["seconds_samples"]["one_by_one"])),
            Timing(tuple(lm_steps["seconds_samples"]["together"])),
        )
        report |= {
            "lm_steps": lm_steps,
            **failed.bounded_fields("lm_steps_speedup", speedup, 0.0, args.concurrent, BATCH_RATIO_BOUND),
        }
    report["failed_measurements"] = failed.entries
    print(json.dumps(bench.finish(report), indent=2))


if __name__ == "__main__":
    main()
