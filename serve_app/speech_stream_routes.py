"""Text in as it is written, audio out as it is made: `/v1/audio/speech/stream`, a WebSocket.

The client sends JSON text frames: `start` (OpenAI's speech options: model, voice, response_format, instructions,
speed), then `text` deltas, `flush` (speak what has come so far) and `end`. The server sends the audio as binary
frames, one encoded stream across the whole session, then `speech.audio.done` with the usage (and, where the voice
cannot follow `start`'s instructions, which were ignored, `instructions: "ignored"` with the reason), and closes; a bad
message, or a failure, gets an `error` event in OpenAI's error shape and a close (1008 for the client's errors, 1013
for a 503, 1011 else).

CosyVoice2/3 (`ModelInfo.bistream`): one bi-streamed utterance per session (engine.runtime.bistream, the
official `inference_bistream`): each text delta is tokenized as it comes and its ids go, through this replica's
`TextRelay` actor, to the one decoder call speaking the session, so audio starts before the text is complete;
`flush` changes nothing there. v1, whose LLM has no bi-streaming, is sentence-buffered: each whole sentence
(`engine.text.frontend.complete_sentences`; `flush` and `end` take the rest) is synthesized on the streaming path as
soon as it is complete, one after the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import replace
from functools import partial

import ray
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentResponseGenerator

from deployments.text_relay import TextRelays
from engine.errors import InvalidInputError, TextTooLongError, UnknownVoiceError
from engine.runtime.bistream import BistreamStart
from engine.runtime.synthesis_request import SynthesisRequest
from engine.text.frontend import complete_sentences, is_speakable
from engine.voices.registry import is_voice_id
from observability.http import SynthesisTimer, request_id_of
from serve_app.audio import OPENAI_SAMPLE_RATE, StreamEncoder
from serve_app.errors import ServiceUnavailableError, unavailable_error
from serve_app.guard import WEBSOCKET_PROTOCOL
from serve_app.health_routes import HEALTH_PROBE_TIMEOUT_S
from serve_app.openai_routes import OpenAIRoutes
from serve_app.responses import OutputAudio
from serve_app.schemas import StreamEnd, StreamFlush, StreamStart, StreamText
from serve_app.synthesis import Synthesis, call, delivery, usage_of
from serve_app.tenancy import caller_of
from serve_app.text_stream import (
    ClientLeftError,
    TextStream,
    TextStreamSlots,
    close_code,
    done_event,
    error_event,
    refuse_text_stream,
)

logger = logging.getLogger("ray.serve")

STREAM_PATH = "/v1/audio/speech/stream"


class SpeechStreamRoutes:
    """The text stream WebSocket, on the replica's `Synthesis`; its `start` message is read as OpenAI's speech
    options (`OpenAIRoutes.openai_request`), and CosyVoice2/3's text goes to the decoders through `text_relays`."""

    def __init__(self, synthesis: Synthesis, openai: OpenAIRoutes, text_relays: TextRelays) -> None:
        self.synthesis = synthesis
        self.openai = openai
        self.text_relays = text_relays
        self.limits = synthesis.limits
        self.text_stream_slots = TextStreamSlots(self.limits.max_text_streams, self.limits.max_text_streams_per_key)

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_websocket_route(STREAM_PATH, self.speech_stream)
        return router

    async def speech_stream(self, ws: WebSocket) -> None:
        """Text deltas in, audio out as each sentence is complete (the module's docstring has the protocol)."""
        owner = caller_of(ws.scope).owner
        refusal = self.text_stream_slots.acquire(owner)
        if refusal is not None:
            await refuse_text_stream(ws, refusal)
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
        stream = TextStream(ws, self.limits.max_body_bytes)
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
        info = await self.synthesis.model_info()
        request, stream.ignored_instructions = await self.openai.openai_request(start, "", caller, info)
        fmt = delivery("stream", start.response_format, info, start.speed).format
        request = self.synthesis.checked(request, info)
        if request.voice not in info.voices and not is_voice_id(request.voice):
            # Known before any text comes (a registered voice's id is looked up with the first sentence).
            raise UnknownVoiceError(
                f"unknown voice {request.voice!r}: neither a built-in speaker nor a registered voice (GET /v1/voices "
                "lists both)"
            )
        output = OutputAudio(fmt, info.sample_rate, OPENAI_SAMPLE_RATE)
        timer = SynthesisTimer(STREAM_PATH, "websocket", info.sample_rate)
        usage = partial(usage_of, timer, info=info)
        if info.bistream:
            await self.speak_bistream(stream, request, output.stream_encoder(), timer, request_id)
            return usage(stream.bistream_tokens)
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
        return usage(input_tokens)

    async def speak_bistream(
        self,
        stream: TextStream,
        request: SynthesisRequest,
        encoder: StreamEncoder,
        timer: SynthesisTimer,
        request_id: str,
    ) -> None:
        """CosyVoice2/3: one bi-streamed utterance for the whole session, each text delta's ids joining the LLM as it
        comes (engine.runtime.bistream), through this replica's `TextRelay` to one decoder call."""
        caller = caller_of(stream.ws.scope)
        start = await call(partial(self.synthesis.encoder.bistream_start.remote, request, request_id, caller))
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
                self.synthesis.check_length(received)
                if not message.text:
                    continue
                if not spoken:  # timed from the first text, not from the client's start
                    timer.started = time.perf_counter()
                spoken = spoken or is_speakable(message.text)
                tokens = await call(partial(self.synthesis.encoder.text_piece_tokens.remote, message.text))
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
            self.synthesis.check_text(received)  # empty, or punctuation only
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
        """The decoder's audio of the bi-streamed utterance, sent as it comes. A call whose replica is lost before its
        first audio is made again (`Synthesis.rerouted`): the relay keeps the session's pieces for it."""

        def decode_call() -> DeploymentResponseGenerator:
            handle = self.synthesis.router.handle()
            return handle.bistream.options(stream=True).remote(start, relay, session, request_id)

        async with contextlib.aclosing(self.synthesis.rerouted(decode_call, request_id)) as chunks:
            async for chunk in chunks:
                timer.audio(chunk)
                stream.active()
                if data := encoder.encode(chunk):
                    await stream.ws.send_bytes(data)
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
                self.synthesis.check_length(received)
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
            self.synthesis.check_text(received)  # empty, or punctuation only
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
            encode_first = self.synthesis.encoder.encode_first.remote
            first, plan = await call(partial(encode_first, sentence, request_id, caller))
            input_tokens += sum(len(segment.text) for segment in plan.texts)
            async for chunk in self.synthesis.stream_audio(first, plan, request_id):
                timer.audio(chunk)
                if data := encoder.encode(chunk):
                    await stream.ws.send_bytes(data)
            stream.pending -= 1
            stream.active()  # the idle time counts from its audio's end
        if data := encoder.finish():
            await stream.ws.send_bytes(data)
        return input_tokens
