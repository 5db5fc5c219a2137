"""What a synthesis sends: the audio in its format and rate (`OutputAudio`), a stream's bytes as they are encoded,
and OpenAI's SSE events with the request's `usage`."""

import base64
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from serve_app.audio import AudioFormat, StreamEncoder, encode_audio, resample, stream_encoder
from serve_app.errors import error_payload

logger = logging.getLogger("ray.serve")

SSE_MEDIA_TYPE = "text/event-stream"
Chunk = np.ndarray | None  # the first audio chunk of a stream, None when the stream had no audio


def sse_event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def iter_once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def encoded_stream(
    encoder: StreamEncoder, first: Chunk, rest: AsyncIterator[np.ndarray], request_id: str
) -> AsyncIterator[bytes]:
    """The response bytes of an audio stream: each decoded chunk through the format's encoder, as it arrives.
    A failure after the status line aborts the connection, so the client sees a broken stream, not a short file."""
    try:
        pending = encoder.encode(first) if first is not None else b""
        async for chunk in rest:
            data = pending + encoder.encode(chunk)
            pending = b""
            if data:
                yield data
        data = pending + encoder.finish()
        if data:
            yield data
    except Exception:
        logger.error("the stream failed after its first chunk", exc_info=True, extra={"request_id": request_id})
        raise


@dataclass(frozen=True)
class OutputAudio:
    """How a response's audio is written: its format, the model's rate and the rate sent."""

    format: AudioFormat
    model_rate: int
    rate: int

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Sample-Rate": str(self.rate)}

    def encode(self, audio: np.ndarray) -> bytes:
        """A whole file (true sizes in a wav header)."""
        return encode_audio(resample(audio, self.model_rate, self.rate), self.rate, self.format.name)

    def stream_encoder(self) -> StreamEncoder:
        return stream_encoder(self.format.name, self.rate, input_rate=self.model_rate)


def speech_usage(input_tokens: int, audio_s: float, speech_tokens_per_s: int) -> dict[str, int]:
    """OpenAI's `usage` of a `speech.audio.done` event: the text tokens the model read (the input's own, without
    prompts or instructions) and the audio's length in the model's speech tokens (50 a second for v1, 25 for
    CosyVoice2 and 3)."""
    output_tokens = round(audio_s * speech_tokens_per_s)
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}


async def sse_body(
    encoded: AsyncIterator[bytes], request_id: str, usage: Callable[[], dict[str, int]]
) -> AsyncIterator[bytes]:
    """OpenAI's speech events: the file's bytes in base64 `speech.audio.delta` events, then `speech.audio.done`
    with the request's `usage`; a failure mid-stream ends it with an `error` event."""
    try:
        async for data in encoded:
            yield sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    except Exception as exc:
        _, body = error_payload(exc, request_id)
        yield sse_event({"type": "error", **body})
        return
    yield sse_event({"type": "speech.audio.done", "usage": usage()})
