"""The Wyoming listener: a TCP server that answers each client's events in order, speaking through the ingress's
deployment handle (`serve_app.wyoming_speech`). Per connection:

- `describe` -> `info`: the model and the voices a client without a key may use;
- `synthesize` -> `audio-start`, `audio-chunk`s (16-bit mono PCM at the model's rate, each as it is decoded),
  `audio-stop`;
- `synthesize-start`, `synthesize-chunk`s, `synthesize-stop` -> the same audio events, each sentence spoken as soon as
  its text is complete, then `synthesize-stopped` (a `synthesize` inside such a stream repeats its text for older
  servers and is dropped, as Wyoming asks);
- any other event is dropped, as Wyoming servers do.

A request that fails (bad input, an unknown voice, a full server) is answered with an `error` event, and the connection
is closed: a client waiting for `audio-stop` would otherwise wait for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from ray.serve.handle import DeploymentHandle
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.info import Describe
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from engine.errors import InvalidInputError
from engine.text.frontend import complete_sentences, is_speakable
from engine.voices.registry import Caller
from observability.http import ABORTED, COMPLETE, ingress_metrics
from serve_app.errors import ServiceUnavailableError, StreamIdleError, error_payload
from serve_app.request_args import LimitsArgs
from serve_app.text_stream import TEXT_STREAM_IDLE_S
from serve_app.wyoming_events import check_plain_text, event_text, event_voice, info_event, read_event
from serve_app.wyoming_speech import WYOMING_ENDPOINT

logger = logging.getLogger("ray.serve")

T = TypeVar("T")

SAMPLE_WIDTH_BYTES, CHANNELS = 2, 1  # 16-bit mono
# A client that takes in no audio for this long has stopped reading: its connection is closed, its decode cancelled.
SEND_TIMEOUT_S = 30.0


class ClientLeftError(Exception):
    """The client closed the connection, or stopped reading what it is sent."""


@dataclass
class TextStream:
    """A `synthesize-start` ... `synthesize-stop` stream: its text's whole sentences, queued to be spoken in order
    (None: its end), and the task speaking them."""

    voice: str | None
    request_id: str
    max_chars: int
    received: str = ""
    buffer: str = ""  # text after the last whole sentence
    pending: int = 0  # sentences queued or being spoken
    spoken: bool = False  # anything speakable queued
    sentences: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    speaker: asyncio.Task[None] | None = None

    def add(self, text: str) -> None:
        self.received += text
        if len(self.received) > self.max_chars:
            raise InvalidInputError(
                f"the streamed text has passed {self.max_chars} characters, the limit (limits.max_input_chars)"
            )
        self.buffer += text
        whole = complete_sentences(self.buffer)
        self.queue(self.buffer[:whole])
        self.buffer = self.buffer[whole:]

    def end(self) -> None:
        self.queue(self.buffer)
        self.buffer = ""
        if not self.spoken:
            raise InvalidInputError("the streamed text has nothing to speak")
        self.sentences.put_nowait(None)

    def queue(self, text: str) -> None:
        if is_speakable(text):  # punctuation alone has no sound
            self.pending += 1
            self.spoken = True
            self.sentences.put_nowait(text)


class WyomingConnection:
    """One client's events, in order; a synthesis at a time, or one text stream whose sentences are spoken while its
    text comes in. The client is taken to have left when it closes its side (Wyoming's clients never half-close): the
    synthesis is then cancelled, freeing its decoder slot."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listener: WyomingListener) -> None:
        self.reader = reader
        self.writer = writer
        self.listener = listener
        self.connection_id = uuid.uuid4().hex
        self.stream: TextStream | None = None
        self.synthesis_id: str | None = None  # the request id of the synthesis being answered
        self.audio_started = False
        self._reading: asyncio.Future[Event | None] | None = None
        self._sending = asyncio.Lock()
        self._active_at = time.monotonic()

    async def serve(self) -> None:
        """Answer the client until it leaves or a request fails (an `error` event, then the close)."""
        try:
            while True:
                await self.handle(await self.next_event())
        except ClientLeftError:
            if self.synthesis_id is not None:
                logger.info("the Wyoming client left", extra={"request_id": self.synthesis_id})
                record_request(200, ABORTED)
        except Exception as exc:
            await self.fail(exc)
        finally:
            await self.close()

    async def handle(self, event: Event) -> None:
        if Describe.is_type(event.type):
            catalog = await self.listener.ingress.wyoming_catalog.remote(self.listener.caller)
            await self.send(info_event(catalog))
        elif Synthesize.is_type(event.type):
            if self.stream is None:  # inside a stream it repeats the streamed text for servers without streaming
                await self.synthesize(event)
        elif SynthesizeStart.is_type(event.type):
            if self.stream is not None:
                raise InvalidInputError("synthesize-start inside a text stream: end that one with synthesize-stop")
            check_plain_text(event)
            self.synthesis_id = uuid.uuid4().hex
            self.stream = TextStream(event_voice(event), self.synthesis_id, self.listener.limits.max_input_chars)
            self.stream.speaker = asyncio.create_task(self.speak_stream(self.stream))
        elif SynthesizeChunk.is_type(event.type):
            if self.stream is None:
                raise InvalidInputError("synthesize-chunk outside a text stream: send synthesize-start first")
            text = event_text(event)
            self.stream.add(text)
            if is_speakable(text):
                self.active()
        elif SynthesizeStop.is_type(event.type):
            if self.stream is None:
                raise InvalidInputError("synthesize-stop outside a text stream: send synthesize-start first")
            await self.finish_stream(self.stream)

    async def synthesize(self, event: Event) -> None:
        check_plain_text(event)
        text, voice = event_text(event), event_voice(event)
        self.synthesis_id = uuid.uuid4().hex
        await self.until_done(self.speak(text, voice, self.synthesis_id))
        await self.end_audio()
        self.active()

    async def speak_stream(self, stream: TextStream) -> None:
        while (text := await stream.sentences.get()) is not None:
            await self.speak(text, stream.voice, stream.request_id)
            stream.pending -= 1
            self.active()  # the idle time counts from its audio's end

    async def finish_stream(self, stream: TextStream) -> None:
        assert stream.speaker is not None
        stream.end()
        await self.until_done(stream.speaker)
        await self.end_audio()
        await self.send(SynthesizeStopped().event())
        self.stream = None

    async def speak(self, text: str, voice: str | None, request_id: str) -> None:
        """Send `text`'s audio as it is decoded, `audio-start` before the connection's first chunk."""
        listener = self.listener
        response = listener.ingress.wyoming_speech.options(stream=True).remote(text, voice, listener.caller, request_id)
        try:
            async for rate, pcm in response:
                if not self.audio_started:
                    await self.send(AudioStart(rate=rate, width=SAMPLE_WIDTH_BYTES, channels=CHANNELS).event())
                    self.audio_started = True
                await self.send(AudioChunk(rate=rate, width=SAMPLE_WIDTH_BYTES, channels=CHANNELS, audio=pcm).event())
        finally:
            # A call whose iteration was left (the client went, the connection failed) is cancelled, which stops its
            # decode; a no-op once it ended, and one that failed re-raises its error here, which is already on its way.
            with contextlib.suppress(Exception):
                response.cancel()

    async def end_audio(self) -> None:
        """`audio-stop` after a synthesis (`audio-start` came with its first chunk), counted as a request served."""
        await self.send(AudioStop().event())
        self.audio_started = False
        record_request(200, COMPLETE)
        self.synthesis_id = None

    def active(self) -> None:
        """The client asked for speech, or got some: its idle clock starts again."""
        self._active_at = time.monotonic()

    def reading(self) -> asyncio.Future[Event | None]:
        """The read of the client's next event: one at a time, kept across waits (a cancelled read could lose an
        event's bytes)."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(read_event(self.reader, self.listener.limits.max_body_bytes))
        return self._reading

    async def next_event(self) -> Event:
        """The client's next event; ClientLeftError once it has closed the connection; StreamIdleError once it has
        asked for nothing to speak for the listener's `idle_s` while no audio is in the making; a failure of the
        text stream's speaker as soon as it fails."""
        idle_s = self.listener.idle_s
        while True:
            reading = self.reading()
            speaker = self.stream.speaker if self.stream is not None else None
            watched = {reading} if speaker is None else {reading, speaker}
            timeout = max(0.0, self._active_at + idle_s - time.monotonic())
            done, _ = await asyncio.wait(watched, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if speaker in done:
                speaker.result()  # it ends before synthesize-stop only by failing
            if reading in done:
                break
            if not done:
                if self.stream is not None and self.stream.pending:  # the client may wait for its audio
                    self.active()
                else:
                    raise StreamIdleError(f"nothing to speak for {idle_s:g} s and no audio in the making")
        event, self._reading = reading.result(), None
        if event is None:
            raise ClientLeftError
        return event

    async def until_done(self, work: Awaitable[T]) -> T:
        """`work`'s result, cancelling it if the client leaves meanwhile (an event it sends meanwhile waits for the
        next `next_event`)."""
        task = asyncio.ensure_future(work)
        try:
            reading = self.reading()
            await asyncio.wait({task, reading}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and reading.done() and reading.exception() is None and reading.result() is None:
                raise ClientLeftError
            return await task
        finally:
            task.cancel()

    async def send(self, event: Event) -> None:
        async with self._sending:
            try:
                await asyncio.wait_for(async_write_event(event, self.writer), SEND_TIMEOUT_S)
            except (asyncio.TimeoutError, ConnectionError) as exc:
                raise ClientLeftError from exc

    async def fail(self, exc: BaseException) -> None:
        """Answer the failure with an `error` event (the HTTP API's message and code), as far as the client still
        listens."""
        request_id = self.synthesis_id or self.connection_id
        status, body = error_payload(exc, request_id)
        error = body["error"]
        logger.info("Wyoming request ended with %d: %s", status, error["message"], extra={"request_id": request_id})
        if self.synthesis_id is not None:
            record_request(status, COMPLETE)
        with contextlib.suppress(ClientLeftError):
            await self.send(Error(text=error["message"], code=error["code"]).event())

    async def close(self) -> None:
        """Stop what still runs for the client (a read, a text stream's decode) and close the connection."""
        pending = [task for task in (self._reading, self.stream and self.stream.speaker) if task is not None]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


def record_request(status: int, outcome: str) -> None:
    """Count a Wyoming synthesis as the HTTP middleware counts requests (`endpoint` wyoming)."""
    tags = {"endpoint": WYOMING_ENDPOINT, "status_code": str(status), "outcome": outcome}
    ingress_metrics().requests.inc(tags=tags)


# Connections the listener holds at once: a Home Assistant holds a few, and each synthesis is bounded by the
# ingress's own limits besides.
MAX_CONNECTIONS = 16


class WyomingListener:
    """The TCP listener: a `WyomingConnection` per client, at most `MAX_CONNECTIONS` at once (one more is answered
    with an `error` event and closed), each ended after `idle_s` without anything to speak (the tests pass a short
    one)."""

    def __init__(
        self, ingress: DeploymentHandle, caller: Caller, limits: LimitsArgs, idle_s: float = TEXT_STREAM_IDLE_S
    ) -> None:
        self.ingress = ingress
        self.caller = caller
        self.idle_s = idle_s
        self.limits = limits
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        # The reader's limit bounds an event's header line (its data and payload are bounded as they are read).
        self.server = await asyncio.start_server(self.accept, host, port, limit=self.limits.max_body_bytes)

    @property
    def serving(self) -> bool:
        return self.server is not None and self.server.is_serving()

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = WyomingConnection(reader, writer, self)
        if self.connections >= MAX_CONNECTIONS:
            refusal = ServiceUnavailableError(
                f"this server holds its most Wyoming connections at once ({MAX_CONNECTIONS}); retry later"
            )
            await connection.fail(refusal)
            await connection.close()
            return
        self.connections += 1
        try:
            await connection.serve()
        finally:
            self.connections -= 1
