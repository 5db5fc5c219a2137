"""One text stream's session on the ingress (`/v1/audio/speech/stream`, `serve_app.speech_stream_routes`): its
messages as they come (`TextStream`), the slots the streams hold (`TextStreamSlots`), and its last message or close.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

from fastapi import WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from engine.errors import InvalidInputError
from serve_app.errors import (
    RETRY_AFTER_S,
    StreamIdleError,
    error_body,
    error_payload,
    validation_message,
    validation_param,
)
from serve_app.schemas import StreamMessage
from serve_app.tenancy import KeySlots

MESSAGES: TypeAdapter[StreamMessage] = TypeAdapter(StreamMessage)
# WebSocket close codes (RFC 6455): the client's error, a server at capacity, any other failure.
CLOSE_POLICY, CLOSE_TRY_LATER, CLOSE_ERROR = 1008, 1013, 1011


class ClientLeftError(Exception):
    """The client closed the WebSocket (or lost it): nothing more can be sent."""


def close_code(status: int) -> int:
    return CLOSE_POLICY if status < 500 else CLOSE_TRY_LATER if status == 503 else CLOSE_ERROR


# A text stream (or a Wyoming connection) that asks for nothing to speak this long while none of its audio is being
# made is ended, freeing its ingress slot: a client between sentences sends text well within it, and a socket left
# open gives its slot back within a minute (the value since text streams came; no measurement tuned it).
TEXT_STREAM_IDLE_S = 60.0


async def refuse_text_stream(ws: WebSocket, message: str) -> None:
    """Refuse a handshake at once with a 503 and `Retry-After` (1013 where the server cannot answer a handshake with a
    response: it can only close it, which the client sees as a 403)."""
    headers = {"Retry-After": str(max(0, math.ceil(RETRY_AFTER_S)))}
    try:
        await ws.send_denial_response(JSONResponse(error_body(503, message, "text_streams_at_capacity"), 503, headers))
    except RuntimeError:  # no ASGI WebSocket denial response
        await ws.close(CLOSE_TRY_LATER)


def error_event(exc: BaseException, request_id: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, `error` event) for what ended a stream: a bad message as the HTTP API answers a bad body."""
    if isinstance(exc, ValidationError):
        # Each message's type is a tag of the union, first in every error's location: not a field.
        errors = [{**error, "loc": error["loc"][1:]} for error in exc.errors()]
        invalid = RequestValidationError(errors)
        return 400, {
            "type": "error",
            **error_body(400, validation_message(invalid), "invalid_request", validation_param(invalid)),
        }
    status, body = error_payload(exc, request_id)
    return status, {"type": "error", **body}


def done_event(usage: dict[str, int], ignored_instructions: str | None) -> dict[str, Any]:
    """A session's last message: its usage and, as `/v1/audio/speech`'s X-Instructions headers say it, whether (and
    why) its instructions were ignored."""
    event: dict[str, Any] = {"type": "speech.audio.done", "usage": usage}
    if ignored_instructions is not None:
        event |= {"instructions": "ignored", "instructions_reason": ignored_instructions}
    return event


class TextStream:
    """One session's messages: a single pending receive (a cancelled one could lose a message), bounded frames, and
    the idle clock. Only what makes audio starts that clock again (text to speak, audio sent: `active`), not any
    message, so a session that sends `flush` or empty text forever still ends; it does not run out while a sentence
    waits to be spoken or is spoken."""

    def __init__(self, ws: WebSocket, max_frame_bytes: int, idle_s: float = TEXT_STREAM_IDLE_S) -> None:
        self.ws = ws
        self.max_frame_bytes = max_frame_bytes
        self.idle_s = idle_s
        self.pending = 0  # sentences queued and not yet spoken
        self.bistream_tokens = 0  # bi-streaming: the text ids sent to the decoder
        self.ignored_instructions: str | None = None  # why `start`'s instructions go unfollowed, if they do
        self._receiving: asyncio.Future[Any] | None = None
        self._active_at = time.monotonic()

    def active(self) -> None:
        """The session did something that makes audio: its idle clock starts again."""
        self._active_at = time.monotonic()

    async def next_message(self, idle: bool = True) -> StreamMessage:
        """The next message, parsed; ClientLeftError when the client went, StreamIdleError once the session has made
        no audio for the idle time."""
        if self._receiving is None:
            self._receiving = asyncio.ensure_future(self.ws.receive())
        while True:
            timeout = max(0.0, self._active_at + self.idle_s - time.monotonic()) if idle else None
            done, _ = await asyncio.wait({self._receiving}, timeout=timeout)
            if done:
                break
            if self.pending:  # a sentence waits or is spoken: the client may wait for its audio
                self.active()
            elif time.monotonic() >= self._active_at + self.idle_s:
                raise StreamIdleError(f"nothing to speak for {self.idle_s:g} s and no audio in the making")
        message, self._receiving = self._receiving.result(), None
        if message["type"] == "websocket.disconnect":
            raise ClientLeftError
        text = message.get("text")
        if text is None:
            raise InvalidInputError('send JSON text frames: {"type": "start" | "text" | "flush" | "end", ...}')
        if len(text.encode()) > self.max_frame_bytes:
            raise InvalidInputError(f"a message is larger than {self.max_frame_bytes} bytes (limits.max_body_bytes)")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"malformed JSON message: {exc}") from None
        except RecursionError:  # the parser's own depth bound, which an HTTP body meets as a 400 too
            raise InvalidInputError("malformed JSON message: nested too deeply") from None
        return MESSAGES.validate_python(data)

    def close(self) -> None:
        if self._receiving is not None:
            self._receiving.cancel()


class TextStreamSlots:
    """The text streams an ingress replica holds: at most `limit` (limits.max_text_streams, below the replica's
    max_ongoing_requests, so that sockets never take the slots plain requests need), and at most `per_key` of one API
    key's (`LimitsArgs.max_text_streams_per_key`, half its requests in flight; None: no bound per key)."""

    def __init__(self, limit: int, per_key: int | None) -> None:
        self.limit = limit
        self.per_key = per_key
        self.held = 0
        self._keys = KeySlots()

    def acquire(self, owner: str | None) -> str | None:
        """Take a slot for a session of `owner` (None: keys off) -> None, or why there is none."""
        if self.held >= self.limit:
            return f"this server holds its most text streams at once ({self.limit}, limits.max_text_streams); retry"
        if owner is not None and self.per_key is not None and not self._keys.acquire(owner, self.per_key):
            return (
                f"this API key holds its most text streams at once ({self.per_key}, half its requests in flight); "
                "retry when one has ended"
            )
        self.held += 1
        return None

    def release(self, owner: str | None) -> None:
        self.held -= 1
        if owner is not None and self.per_key is not None:
            self._keys.release(owner)
