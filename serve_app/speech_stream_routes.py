"""Text in as it is written, audio out as it is made: `/v1/audio/speech/stream`, a WebSocket.

The client sends JSON text frames: `start` (OpenAI's speech options: model, voice, response_format, instructions,
speed), then `text` deltas, `flush` (speak what has come so far) and `end`. The server sends the audio as binary
frames, one encoded stream across the whole session, then `speech.audio.done` with the usage (and, where the voice
cannot follow `start`'s instructions, which were ignored, `instructions: "ignored"` with the reason), and closes; a bad
message, or a failure, gets an `error` event in OpenAI's error shape and a close (1008 for the client's errors, 1013
for a 503, 1011 else).

CosyVoice2/3 (`bistream` in the encoder's info): one bi-streamed utterance per session (engine.runtime.bistream, the
official `inference_bistream`): each text delta is tokenized as it comes and its ids go, through this replica's
`TextRelay` actor, to the one decoder call speaking the session, so audio starts before the text is complete;
`flush` changes nothing there. v1, whose LLM has no bi-streaming, is sentence-buffered: each whole sentence
(`engine.text.frontend.complete_sentences`; `flush` and `end` take the rest) is synthesized on the streaming path as
soon as it is complete, one after the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from dataclasses import replace
from functools import partial
from typing import Any

import ray
from fastapi import WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError
from ray.exceptions import RayActorError

from engine.errors import InvalidInputError, TextTooLongError, UnknownVoiceError
from engine.runtime.bistream import BistreamStart
from engine.runtime.synthesis_request import SynthesisRequest
from engine.text.frontend import complete_sentences, is_speakable
from engine.voices.registry import is_voice_id
from observability.http import SynthesisTimer, request_id_of
from serve_app.api import api
from serve_app.audio import OPENAI_SAMPLE_RATE, StreamEncoder
from serve_app.errors import (
    REPLICA_LOST,
    SERVE_UNAVAILABLE,
    ServiceUnavailableError,
    StreamIdleError,
    error_body,
    error_payload,
    unavailable_error,
    validation_message,
    validation_param,
)
from serve_app.guard import WEBSOCKET_PROTOCOL
from serve_app.health_routes import HEALTH_PROBE_TIMEOUT_S
from serve_app.openai_routes import OpenAIRoutes
from serve_app.responses import OutputAudio
from serve_app.schemas import StreamEnd, StreamFlush, StreamMessage, StreamStart, StreamText
from serve_app.tenancy import KeySlots, caller_of

logger = logging.getLogger("ray.serve")

STREAM_PATH = "/v1/audio/speech/stream"
MESSAGES: TypeAdapter[StreamMessage] = TypeAdapter(StreamMessage)
# WebSocket close codes (RFC 6455): the client's error, a server at capacity, any other failure.
CLOSE_POLICY, CLOSE_TRY_LATER, CLOSE_ERROR = 1008, 1013, 1011


class ClientLeftError(Exception):
    """The client closed the WebSocket (or lost it): nothing more can be sent."""


def close_code(status: int) -> int:
    return CLOSE_POLICY if status < 500 else CLOSE_TRY_LATER if status == 503 else CLOSE_ERROR


async def refuse_text_stream(ws: WebSocket, message: str, retry_after_s: float) -> None:
    """Refuse a handshake at once with a 503 and `Retry-After` (1013 where the server cannot answer a handshake with a
    response: it can only close it, which the client sees as a 403)."""
    headers = {"Retry-After": str(max(0, math.ceil(retry_after_s)))}
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

    def __init__(self, ws: WebSocket, max_frame_bytes: int, idle_s: float) -> None:
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
                raise StreamIdleError(
                    f"nothing to speak for {self.idle_s:g} s and no audio in the making (limits.text_stream_idle_s)"
                )
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
    key's (limits.max_text_streams_per_key; None: no bound per key)."""

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
                f"this API key holds its most text streams at once ({self.per_key}, limits.max_text_streams_per_key); "
                "retry when one has ended"
            )
        self.held += 1
        return None

    def release(self, owner: str | None) -> None:
        self.held -= 1
        if owner is not None and self.per_key is not None:
            self._keys.release(owner)


class SpeechStreamRoutes(OpenAIRoutes):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.text_stream_slots = TextStreamSlots(self.limits.max_text_streams, self.limits.max_text_streams_per_key)

    @api.websocket(STREAM_PATH)
    async def speech_stream(self, ws: WebSocket) -> None:
        """Text deltas in, audio out as each sentence is complete (the module's docstring has the protocol)."""
        owner = caller_of(ws.scope).owner
        refusal = self.text_stream_slots.acquire(owner)
        if refusal is not None:
            await refuse_text_stream(ws, refusal, self.limits.retry_after_s)
            return
        try:
            await self.serve_text_stream(ws)
        finally:
            self.text_stream_slots.release(owner)

    async def serve_text_stream(self, ws: WebSocket) -> None:
        """One text stream, from its handshake to its close, whatever ends it."""
        # A browser offers `WEBSOCKET_PROTOCOL` beside the one that carries its key: the server must pick one.
        await ws.accept(
            subprotocol=WEBSOCKET_PROTOCOL if WEBSOCKET_PROTOCOL in ws.scope.get("subprotocols", ()) else None
        )
        request_id = request_id_of(ws.scope)
        stream = TextStream(ws, self.limits.max_body_bytes, self.limits.text_stream_idle_s)
        try:
            usage = await self.speak_stream(stream, request_id)
            await ws.send_json(done_event(usage, stream.ignored_instructions))
            await ws.close()
        except (ClientLeftError, WebSocketDisconnect):  # the latter: a send after the client left
            logger.info("the client left the text stream", extra={"request_id": request_id})
        except Exception as exc:
            status, event = error_event(exc, request_id)
            logger.info(
                "text stream ended with %d: %s", status, event["error"]["message"], extra={"request_id": request_id}
            )
            with contextlib.suppress(Exception):  # the client may have left meanwhile
                await ws.send_json(event)
                await ws.close(close_code(status))
        finally:
            stream.close()

    async def speak_stream(self, stream: TextStream, request_id: str) -> dict[str, int]:
        """Take the `start` message, then speak each sentence as its text comes; the usage."""
        start = await stream.next_message()
        if not isinstance(start, StreamStart):
            raise InvalidInputError(f'the first message must be {{"type": "start", ...}}, not {start.type!r}')
        caller = caller_of(stream.ws.scope)
        request, stream.ignored_instructions = await self.openai_request(start, "", caller)
        request, fmt, info = await self.checked(request, start.response_format, "stream")
        if request.voice not in info["voices"] and not is_voice_id(request.voice):
            # Known before any text comes (a registered voice's id is looked up with the first sentence).
            raise UnknownVoiceError(
                f"unknown voice {request.voice!r}: neither a built-in speaker nor a registered voice (GET /v1/voices "
                "lists both)"
            )
        output = OutputAudio(fmt, info["sample_rate"], OPENAI_SAMPLE_RATE, self.audio.bit_rate(fmt.name))
        timer = SynthesisTimer(STREAM_PATH, "websocket", info["sample_rate"])
        if info.get("bistream"):
            return await self.speak_bistream(stream, request, output.stream_encoder(), timer, request_id)
        sentences: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(
            self.speak_sentences(stream, sentences, request, output.stream_encoder(), timer, request_id)
        )
        reader = asyncio.create_task(self.read_text(stream, sentences))
        try:
            done, _ = await asyncio.wait({speaker, reader}, return_when=asyncio.FIRST_COMPLETED)
            # The reader ends only by an error or the client leaving (it reads on after `end`, to see the latter):
            # asked first, so that a client who left is not reported as the speaker's failed send.
            if reader in done:
                reader.result()
            input_tokens = speaker.result()
        finally:  # cancelling the speaker cancels its decoder and encoder calls (`stream_audio`): the slot is freed
            for task in (speaker, reader):
                task.cancel()
            await asyncio.gather(speaker, reader, return_exceptions=True)
        timer.done()
        return self.usage_of(timer, input_tokens)

    async def speak_bistream(
        self,
        stream: TextStream,
        request: SynthesisRequest,
        encoder: StreamEncoder,
        timer: SynthesisTimer,
        request_id: str,
    ) -> dict[str, int]:
        """CosyVoice2/3: one bi-streamed utterance for the whole session, each text delta's ids joining the LLM as it
        comes (engine.runtime.bistream), through this replica's `TextRelay` to one decoder call; the usage."""
        caller = caller_of(stream.ws.scope)
        start = await self.call(partial(self.encoder.bistream_start.remote, request, request_id, caller))
        relay, session = self.text_relays.relay(), uuid.uuid4().hex
        speaker = asyncio.create_task(self.speak_relayed(stream, start, relay, session, encoder, timer, request_id))
        reader = asyncio.create_task(self.relay_text(stream, relay, session, timer))
        try:
            done, _ = await asyncio.wait({speaker, reader}, return_when=asyncio.FIRST_COMPLETED)
            if reader in done:  # as in speak_stream: a client who left is not reported as a failed send
                reader.result()
            speaker.result()
        except ServiceUnavailableError:  # a lost replica: the decoder's, or the relay the decoder read from
            await self.text_relays.problem(HEALTH_PROBE_TIMEOUT_S)  # found lost: the next session makes one
            raise
        finally:  # cancelling the speaker cancels its decoder call; a decoder call yet to wait for text ends too
            for task in (speaker, reader):
                task.cancel()
            await asyncio.gather(speaker, reader, return_exceptions=True)
            relay.close.remote(session)
        timer.done()
        return self.usage_of(timer, stream.bistream_tokens)

    async def put_text(self, relay: ray.actor.ActorHandle, session: str, tokens: list[int] | None) -> None:
        """A piece's ids (None: the end) to the session's relay; a lost relay is a 503 (1013), and the next session
        gets a new one."""
        try:
            await relay.put.remote(session, tokens)
        except RayActorError as exc:
            self.text_relays.lost(relay)
            raise unavailable_error(exc) from exc

    async def relay_text(
        self, stream: TextStream, relay: ray.actor.ActorHandle, session: str, timer: SynthesisTimer
    ) -> None:
        """Each text delta's ids to the relay as it arrives (`flush` changes nothing: the text joins as it comes), the
        end after `end`; then, as `read_text`, wait for the client to leave or misbehave. Counts the input tokens in
        `stream.bistream_tokens`."""
        received = ""
        spoken = False
        while True:
            message = await stream.next_message()
            if isinstance(message, StreamText):
                received += message.text
                self.check_length(received)
                if not message.text:
                    continue
                if not spoken:  # timed from the first text, not from the client's start
                    timer.started = time.perf_counter()
                spoken = spoken or is_speakable(message.text)
                tokens = await self.call(partial(self.encoder.text_piece_tokens.remote, message.text))
                stream.bistream_tokens += len(tokens)
                if stream.bistream_tokens > self.limits.max_input_tokens:
                    raise TextTooLongError(
                        f"the text has passed {self.limits.max_input_tokens} tokens, the limit (emoji and rare scripts "
                        "take several tokens a character)"
                    )
                await self.put_text(relay, session, tokens)
                if is_speakable(message.text):
                    stream.active()
            elif isinstance(message, StreamEnd):
                break
            elif not isinstance(message, StreamFlush):
                raise InvalidInputError("the stream has started already: a second start message")
        if not spoken:
            self.check_text(received)  # empty, or punctuation only
            raise InvalidInputError("the input text has nothing to speak")
        await self.put_text(relay, session, None)
        message = await stream.next_message(idle=False)
        raise InvalidInputError(f"a {message.type!r} message after end")

    async def speak_relayed(
        self,
        stream: TextStream,
        start: BistreamStart,
        relay: ray.actor.ActorHandle,
        session: str,
        encoder: StreamEncoder,
        timer: SynthesisTimer,
        request_id: str,
    ) -> None:
        """The decoder's audio of the bi-streamed utterance, sent as it comes."""
        response = self.router.handle().bistream.options(stream=True).remote(start, relay, session, request_id)
        try:
            async for chunk in response:
                timer.audio(chunk)
                stream.active()
                if data := encoder.encode(chunk):
                    await stream.ws.send_bytes(data)
        except (*REPLICA_LOST, *SERVE_UNAVAILABLE) as exc:  # a bi-streamed utterance cannot be sent again
            raise unavailable_error(exc) from exc
        finally:
            # Serve goes on with a call whose iteration was cancelled: the client left or the session failed, so the
            # decoder's call is cancelled (a no-op once it ended; one that failed re-raises its error here).
            with contextlib.suppress(Exception):
                response.cancel()
        if data := encoder.finish():
            await stream.ws.send_bytes(data)

    async def read_text(self, stream: TextStream, sentences: asyncio.Queue[str | None]) -> None:
        """Queue each whole sentence as its text arrives, the rest at `flush` and `end`, then None; after `end`,
        wait for the client to leave or misbehave (both end the session)."""
        received = buffer = ""
        spoken = False  # anything speakable queued

        def queue(text: str) -> None:
            nonlocal spoken
            if is_speakable(text):  # a piece of punctuation alone has no sound
                stream.pending += 1
                stream.active()
                spoken = True
                sentences.put_nowait(text)

        while True:
            message = await stream.next_message()
            if isinstance(message, StreamText):
                received += message.text
                self.check_length(received)
                buffer += message.text
                whole = complete_sentences(buffer)
                queue(buffer[:whole])
                buffer = buffer[whole:]
            elif isinstance(message, StreamFlush | StreamEnd):
                queue(buffer)
                buffer = ""
                if isinstance(message, StreamEnd):
                    break
            else:
                raise InvalidInputError("the stream has started already: a second start message")
        if not spoken:
            self.check_text(received)  # empty, or punctuation only
            raise InvalidInputError("the input text has nothing to speak")
        sentences.put_nowait(None)
        message = await stream.next_message(idle=False)
        raise InvalidInputError(f"a {message.type!r} message after end")

    async def speak_sentences(
        self,
        stream: TextStream,
        sentences: asyncio.Queue[str | None],
        request: SynthesisRequest,
        encoder: StreamEncoder,
        timer: SynthesisTimer,
        request_id: str,
    ) -> int:
        """Speak the queued sentences in order until None, sending the audio as it is decoded; the input tokens."""
        caller = caller_of(stream.ws.scope)
        input_tokens = 0
        timed = False
        while (text := await sentences.get()) is not None:
            if not timed:  # the stream is timed from its first whole sentence, not from its client's typing
                timer.started, timed = time.perf_counter(), True
            sentence = replace(request, text=text)
            first, plan = await self.call(partial(self.encoder.encode_first.remote, sentence, request_id, caller))
            input_tokens += sum(len(segment.text) for segment in plan.texts)
            async for chunk in self.stream_audio(first, plan, request_id):
                timer.audio(chunk)
                if data := encoder.encode(chunk):
                    await stream.ws.send_bytes(data)
            stream.pending -= 1
            stream.active()  # the idle time counts from its audio's end
        if data := encoder.finish():
            await stream.ws.send_bytes(data)
        return input_tokens
