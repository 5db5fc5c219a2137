"""Stream text into cosyvoice-serve as it is written and save the audio as it comes back.

A voice agent's LLM writes a few words at a time; this sends them, at `--words-per-s`, over the WebSocket
`/v1/audio/speech/stream`, and writes each audio frame to `--out` as it arrives. The server speaks each sentence
as soon as it is complete, so the first audio comes before the text is done:

    python examples/stream_text_ws.py "Hello there. This is spoken as it is typed." --out speech.wav
    some-llm | python examples/stream_text_ws.py - --words-per-s 0 --format pcm --out speech.pcm

`--url` is the server (`http://host:port`, as `cosyvoice-serve run` prints it; default $COSYVOICE_URL, else
http://127.0.0.1:8000) or the WebSocket's own URL (`ws://host:port/v1/audio/speech/stream`). It needs only the
`websockets` library. With API keys on, pass `--api-key` (or set $COSYVOICE_API_KEY).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import websockets

DEFAULT_SERVER_URL = "http://127.0.0.1:8000"
STREAM_PATH = "/v1/audio/speech/stream"


def stream_url(url: str) -> str:
    """The text stream's WebSocket URL for a server URL (http -> ws, https -> wss, the endpoint's path added);
    a ws:// or wss:// URL is taken as it is."""
    if url.startswith(("ws://", "wss://")):
        return url
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if url.startswith(http):
            return ws + url.removeprefix(http).rstrip("/") + STREAM_PATH
    raise ValueError(f"--url {url!r}: give the server's http(s):// URL or the stream's ws(s):// URL")


class StreamError(Exception):
    """The server's `error` event: `error` is OpenAI's error object (message, type, code)."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", "error"))
        self.error = error


@dataclass
class StreamResult:
    usage: dict[str, int]
    audio_bytes: int = 0
    first_audio_s: float | None = None  # from the connection being open
    end_sent_s: float | None = None  # when `end` went out, on the same clock
    frames: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)


async def words_of(text: str) -> AsyncIterator[str]:
    for word in text.split():
        yield word


async def stdin_words() -> AsyncIterator[str]:
    """The words of stdin as its lines come (a pipe from a program that writes as it goes)."""
    while line := await asyncio.to_thread(sys.stdin.readline):
        for word in line.split():
            yield word


async def paced(words: AsyncIterable[str], words_per_s: float) -> AsyncIterator[str]:
    """Each word with the space before it, `words_per_s` a second at most (0: as they come)."""
    first = True
    async for word in words:
        if not first and words_per_s > 0:
            await asyncio.sleep(1 / words_per_s)
        yield word if first else " " + word
        first = False


async def stream_text(
    url: str,
    deltas: AsyncIterator[str],
    out: BinaryIO,
    start: dict[str, Any],
    api_key: str | None = None,
) -> StreamResult:
    """Send `start`, each text delta, then `end`; write the audio to `out` as it arrives. The server's done event's
    usage and the timings; StreamError for an error event."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
        opened = time.monotonic()
        result = StreamResult(usage={})

        async def send_text() -> None:
            await ws.send(json.dumps({"type": "start", **start}))
            async for delta in deltas:
                await ws.send(json.dumps({"type": "text", "text": delta}))
            await ws.send(json.dumps({"type": "end"}))
            result.end_sent_s = time.monotonic() - opened

        sender = asyncio.create_task(send_text())
        try:
            async for frame in ws:
                if isinstance(frame, bytes):
                    if result.first_audio_s is None:
                        result.first_audio_s = time.monotonic() - opened
                    result.frames += 1
                    result.audio_bytes += len(frame)
                    out.write(frame)
                    continue
                event = json.loads(frame)
                result.events.append(event)
                if event["type"] == "error":
                    raise StreamError(event["error"])
                if event["type"] == "speech.audio.done":
                    result.usage = event["usage"]
                    await sender
                    return result
            raise StreamError({"message": "the server closed the stream before speech.audio.done"})
        finally:
            sender.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text", help='the text to speak; "-" reads it from stdin, word by word as it comes')
    parser.add_argument("--out", "-o", required=True, help="the audio file to write")
    parser.add_argument(
        "--url",
        default=os.environ.get("COSYVOICE_URL") or DEFAULT_SERVER_URL,
        help="the server, or the stream's ws:// URL (default: $COSYVOICE_URL, else http://127.0.0.1:8000)",
    )
    parser.add_argument("--api-key", default=os.environ.get("COSYVOICE_API_KEY"))
    parser.add_argument("--model", default="tts-1", help="the served model's name or an alias (OpenAI's names)")
    parser.add_argument("--voice", default="alloy", help="a built-in speaker, registered voice id or OpenAI name")
    parser.add_argument("--format", default="wav", choices=("wav", "pcm", "mp3", "opus"))
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--instructions")
    parser.add_argument("--words-per-s", type=float, default=5.0, help="how fast words are sent (0: all at once)")
    options = parser.parse_args(argv)
    try:
        url = stream_url(options.url)
    except ValueError as exc:
        parser.error(str(exc))

    start = {"model": options.model, "voice": options.voice, "response_format": options.format}
    start |= {"speed": options.speed} | ({"instructions": options.instructions} if options.instructions else {})

    async def run() -> StreamResult:
        words = stdin_words() if options.text == "-" else words_of(options.text)
        with open(options.out, "wb") as out:
            return await stream_text(url, paced(words, options.words_per_s), out, start, options.api_key)

    try:
        result = asyncio.run(run())
    except StreamError as exc:
        print(f"error: {exc.error.get('message')} ({exc.error.get('code')})", file=sys.stderr)
        return 1
    except (OSError, websockets.InvalidStatus) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    first = "none" if result.first_audio_s is None else f"{result.first_audio_s:.2f} s"
    print(
        f"wrote {result.audio_bytes} bytes to {options.out}: first audio after {first}, the text's end sent after "
        f"{result.end_sent_s:.2f} s; usage {result.usage}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
