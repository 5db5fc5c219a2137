"""`python -m engine "text" -o out.wav`: synthesise in-process, no server (tiny dummy model by default)."""

from __future__ import annotations

import argparse
import sys
import time

import soundfile as sf

from engine.errors import CosyVoiceError
from engine.loading.loader import PRESETS
from engine.nn.precision import AUTO_DTYPE, AUTO_INT4_DTYPE
from engine.runtime.pipeline import CosyVoice


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    parser.add_argument("text")
    parser.add_argument("-o", "--output", default="out.wav", help="output wav file")
    parser.add_argument("--model", default="tiny", help=f"official model dir, or a preset: {', '.join(PRESETS)}")
    parser.add_argument("--voice", default=None, help="speaker id (default: the model's first voice)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16", AUTO_DTYPE, AUTO_INT4_DTYPE],
        help=f"the decoder's weights; {AUTO_DTYPE}: each module's pick for this device (on CPU by its units), "
        f"{AUTO_INT4_DTYPE}: the same with the LLM in 4 bits (CPU)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--int8", action="store_true", help="INT8 Linear layers for CPU execution")
    parser.add_argument("--instruct", default=None, help="an instruction (v1 -Instruct models)")
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        tts = CosyVoice.load(args.model, dtype=args.dtype, device=args.device, int8=args.int8)
        voice = args.voice or tts.voices[0]
        start = time.perf_counter()
        audio, rate = tts.synthesize(args.text, voice, instruct_text=args.instruct, speed=args.speed, seed=args.seed)
        elapsed = time.perf_counter() - start
    except CosyVoiceError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    sf.write(args.output, audio, rate)
    seconds = len(audio) / rate
    print(
        f"wrote {args.output}: {seconds:.2f} s of audio at {rate} Hz in {elapsed:.2f} s (RTF {elapsed / seconds:.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
