"""Text stream sessions (`/v1/audio/speech/stream`, bi-streamed on CosyVoice2/3) on a running server, as a voice agent
sends them: one sentence a word every `--pause-s`, then `end`; time to the first audio frame and to the done event.

After `--warmup` untimed sessions, `--repeats` rounds: one session alone, then `--concurrent` at once. Headline keys
(median with `_spread` beside it): `alone_first_audio_s`, `alone_total_s`, `concurrent_first_audio_s`,
`concurrent_total_s`. The default run takes about 5 minutes on the 2-core machine with `cosyvoice3-tiny`, whose
random weights speak each session's sentence for ~25 s (311 s, AMD EPYC, 2026-12-07); the time budget
(`--budget-minutes`, default 14) cuts the rounds it leaves no time for, named in `stopped`.

    cosyvoice-serve run --model cosyvoice3-tiny &
    python -m benchmarks.text_streams --url http://127.0.0.1:8000 --out out/text_streams.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import websockets

from serve_app.bench.progress import BenchmarkRun, add_budget_option
from serve_app.bench.timing import Timing, add_repeat_options

TEXT = "Hello there, this text is written a few words at a time, as a language model writes it."
BUDGET_MINUTES = 14.0


async def session(url: str, pause_s: float, voice: str) -> tuple[float, float]:
    """One session -> (seconds to its first audio frame, seconds to its done event); an error event raises."""
    async with websockets.connect(url.replace("http://", "ws://", 1) + "/v1/audio/speech/stream") as ws:
        start = time.perf_counter()
        await ws.send(json.dumps({"type": "start", "model": "tts-1", "voice": voice, "response_format": "pcm"}))
        first: list[float] = []

        async def receive() -> float:
            async for frame in ws:
                if isinstance(frame, bytes):
                    first.append(first[0] if first else time.perf_counter() - start)
                    continue
                event = json.loads(frame)
                if event.get("type") == "speech.audio.done":
                    return time.perf_counter() - start
                if event.get("type") == "error":
                    raise RuntimeError(f"the session ended with an error: {event}")
            raise RuntimeError("the server closed the session without its done event")

        done = asyncio.create_task(receive())
        for word in TEXT.split(" "):
            await ws.send(json.dumps({"type": "text", "text": word + " "}))
            await asyncio.sleep(pause_s)
        await ws.send(json.dumps({"type": "end"}))
        total_s = await done
    if not first:
        raise RuntimeError("the session gave no audio")
    return first[0], total_s


async def measure(options: argparse.Namespace, bench: BenchmarkRun) -> dict[str, Any]:
    url, pause_s, voice = options.url.rstrip("/"), options.pause_s, options.voice
    bench.plan(options.warmup + options.repeats)
    for index in range(options.warmup):
        await session(url, pause_s, voice)
        bench.step(f"warm-up {index + 1}")
    alone: list[tuple[float, float]] = []
    together: list[tuple[float, float]] = []
    for index in range(options.repeats):
        rounds = await bench.within_budget(_round(url, pause_s, voice, options.concurrent), f"round {index + 1}")
        if rounds is None:
            break
        alone.append(rounds[0])
        together += rounds[1]
        bench.step(f"round {index + 1}")
    figures: dict[str, Any] = {"concurrent": options.concurrent, "pause_s": pause_s}
    for name, runs in (("alone", alone), ("concurrent", together)):
        if runs:
            figures |= Timing(tuple(first for first, _ in runs)).fields(f"{name}_first_audio_s")
            figures |= Timing(tuple(total for _, total in runs)).fields(f"{name}_total_s")
    return figures


async def _round(
    url: str, pause_s: float, voice: str, concurrent: int
) -> tuple[tuple[float, float], list[tuple[float, float]]]:
    """One session alone, then `concurrent` at once."""
    alone = await session(url, pause_s, voice)
    return alone, list(await asyncio.gather(*(session(url, pause_s, voice) for _ in range(concurrent))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--voice", default="alloy", help="an OpenAI voice name or one the server lists")
    parser.add_argument("--pause-s", type=float, default=0.05, help="between the words a session sends")
    parser.add_argument("--concurrent", type=int, default=3, help="sessions at once in each round's second part")
    add_repeat_options(parser)
    add_budget_option(parser, BUDGET_MINUTES)
    options = parser.parse_args()
    bench = BenchmarkRun("text_streams", options.out, options.budget_minutes)
    report = bench.finish(asyncio.run(measure(options, bench)))
    print(json.dumps({key: value for key, value in report.items() if key.endswith("_s")}))


if __name__ == "__main__":
    main()
