"""The Wyoming listener: the protocol Home Assistant talks to local text-to-speech engines, on a TCP port of its own
(app args `wyoming`, `cosyvoice-serve run --wyoming-port`; docs/clients.md).

`WyomingServer` is a Serve deployment of one replica that holds the listener and speaks through the ingress's
deployment handle (`serve_app.wyoming_speech`), so a Wyoming synthesis takes the path, limits and metrics of an HTTP
one. Per connection, in order:

- `describe` -> `info`: the model and the voices a client without a key may use;
- `synthesize` -> `audio-start`, `audio-chunk`s (16-bit mono PCM at the model's rate, each as it is decoded),
  `audio-stop`;
- `synthesize-start`, `synthesize-chunk`s, `synthesize-stop` -> the same audio events, each sentence spoken as soon as
  its text is complete, then `synthesize-stopped` (a `synthesize` inside such a stream repeats its text for older
  servers and is dropped, as Wyoming asks);
- any other event is dropped, as Wyoming servers do.

A request that fails (bad input, an unknown voice, a full server) is answered with an `error` event, and the connection
is closed: a client waiting for `audio-stop` would otherwise wait for ever. Events are read with bounds (one event at
most `limits.max_body_bytes`), since `wyoming`'s own reader buffers whatever length a header claims.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ray import serve
from ray.serve.handle import DeploymentHandle
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from engine.errors import InvalidInputError
from engine.text.frontend import complete_sentences, is_speakable, lone_surrogate_at
from engine.voices.registry import EVERYONE, Caller
from observability import STRUCTURED_LOGGING
from observability.http import ABORTED, COMPLETE, ingress_metrics
from serve_app.args import LimitsArgs, SecurityArgs, WyomingArgs
from serve_app.errors import ServiceUnavailableError, StreamIdleError, error_payload
from serve_app.guard import keys_configured
from serve_app.wyoming_speech import WYOMING_ENDPOINT, WyomingCatalog
from serve_app.wyoming_zeroconf import Announcement

logger = logging.getLogger("ray.serve")

T = TypeVar("T")

# A client without a key on a server with keys: it sees the shared voices only (no owner, no admin).
KEYLESS = Caller(owner=None, admin=False)
SAMPLE_WIDTH_BYTES, CHANNELS = 2, 1  # 16-bit mono
# A client that takes in no audio for this long has stopped reading: its connection is closed, its decode cancelled.
SEND_TIMEOUT_S = 30.0
PROGRAM_NAME = "cosyvoice-serve"
ATTRIBUTION = Attribution(name="FunAudioLLM CosyVoice", url="https://github.com/FunAudioLLM/CosyVoice")


class ClientLeftError(Exception):
    """The client closed the connection, or stopped reading what it is sent."""


def json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise InvalidInputError(f"an event's {what} is not JSON") from None
    if not isinstance(value, dict):
        raise InvalidInputError(f"an event's {what} is not a JSON object")
    return value


def declared_length(header: dict[str, Any], key: str, max_bytes: int) -> int:
    length = header.get(key) or 0
    if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= max_bytes:
        raise InvalidInputError(f"an event's {key} must be a whole number of bytes from 0 to {max_bytes}")
    return length


async def read_event(reader: asyncio.StreamReader, max_bytes: int) -> Event | None:
    """The next event (a JSON header line, then its declared data and payload bytes); None once the client has
    closed the connection, also mid-event. InvalidInputError for an event that cannot be read: the connection
    cannot go on after one. The reader's own limit bounds the header line."""
    try:
        line = await reader.readline()
    except ValueError:  # asyncio's LimitOverrunError: no newline within the reader's limit
        raise InvalidInputError(f"an event's header line is longer than {max_bytes} bytes") from None
    if not line.endswith(b"\n"):  # nothing more, or a line cut by the close
        return None
    header = json_object(line, "header")
    event_type = header.get("type")
    if not isinstance(event_type, str):
        raise InvalidInputError('an event header needs "type", a string')
    data = header.get("data") or {}
    if not isinstance(data, dict):
        raise InvalidInputError('an event\'s "data" is not a JSON object')
    data_length = declared_length(header, "data_length", max_bytes)
    payload_length = declared_length(header, "payload_length", max_bytes)
    try:
        if data_length:
            data = data | json_object(await reader.readexactly(data_length), "data")
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError:
        return None
    return Event(type=event_type, data=data, payload=payload)


def event_text(event: Event) -> str:
    text = event.data.get("text")
    if not isinstance(text, str):
        raise InvalidInputError(f'a {event.type} event needs "text", a string')
    index = lone_surrogate_at(text)
    if index is not None:
        raise InvalidInputError(f"the text holds a lone surrogate (U+{ord(text[index]):04X}) at character {index}")
    return text


def event_voice(event: Event) -> str | None:
    """The voice name an event asks for; None (the model's default voice) for none, or a language alone."""
    voice = event.data.get("voice")
    if voice is None:
        return None
    if not isinstance(voice, dict):
        raise InvalidInputError('"voice" must be an object such as {"name": "alloy"}')
    name = voice.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidInputError('"voice"."name" must be a string')
    return name


def check_plain_text(event: Event) -> None:
    text_format = event.data.get("text_format")
    if text_format not in (None, "text"):
        raise InvalidInputError(f"text_format {text_format!r} is not supported: send plain text")


def info_event(catalog: WyomingCatalog) -> Event:
    """Wyoming's `info`: one TTS program, the served model, whose voices each speak every language of the model's
    family (Home Assistant lists a voice under each of its languages, and none without one)."""
    languages = list(catalog.languages)
    voices = [
        TtsVoice(
            name=voice.name,
            attribution=ATTRIBUTION,
            installed=True,
            description=voice.description,
            version=None,
            languages=languages,
        )
        for voice in catalog.voices
    ]
    program = TtsProgram(
        name=PROGRAM_NAME,
        attribution=ATTRIBUTION,
        installed=True,
        description=f"CosyVoice text to speech: {catalog.model} ({catalog.family}, {catalog.sample_rate} Hz)",
        version=None,
        voices=voices,
        supports_synthesize_streaming=True,
    )
    return Info(tts=[program]).event()


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
        asked for nothing to speak for `limits.text_stream_idle_s` while no audio is in the making; a failure of the
        text stream's speaker as soon as it fails."""
        idle_s = self.listener.limits.text_stream_idle_s
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
                    raise StreamIdleError(
                        f"nothing to speak for {idle_s:g} s and no audio in the making (limits.text_stream_idle_s)"
                    )
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


class WyomingListener:
    """The TCP listener: a `WyomingConnection` per client, at most `max_connections` at once (one more is answered
    with an `error` event and closed)."""

    def __init__(self, ingress: DeploymentHandle, caller: Caller, max_connections: int, limits: LimitsArgs) -> None:
        self.ingress = ingress
        self.caller = caller
        self.max_connections = max_connections
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
        if self.connections >= self.max_connections:
            refusal = ServiceUnavailableError(
                f"this server holds its most Wyoming connections at once ({self.max_connections}, "
                "wyoming.max_connections); retry later"
            )
            await connection.fail(refusal)
            await connection.close()
            return
        self.connections += 1
        try:
            await connection.serve()
        finally:
            self.connections -= 1


@serve.deployment(name="WyomingServer", num_replicas=1, logging_config=STRUCTURED_LOGGING)
class WyomingServer:
    """The Wyoming listener's replica: one, since one listener holds the port."""

    async def __init__(
        self, settings: WyomingArgs, limits: LimitsArgs, security: SecurityArgs, ingress_deployment: str
    ) -> None:
        assert settings.port is not None  # built only with a port
        keys_on = keys_configured(security)  # the keys of this replica's environment too
        refusal = settings.keyless_refusal(keys_on)
        if refusal is not None:
            raise RuntimeError(refusal)
        self.warnings = settings.serving_warnings(keys_on)
        for warning in self.warnings:
            logger.warning(warning)
        # The ingress's handle by name: the ingress holds this deployment's (its /healthz asks for the warnings).
        ingress = serve.get_deployment_handle(ingress_deployment)
        self.listener = WyomingListener(ingress, KEYLESS if keys_on else EVERYONE, settings.max_connections, limits)
        await self.listener.start(settings.host, settings.port)
        logger.info("Wyoming listening on %s:%d", settings.host, settings.port)
        self.announcement = await Announcement.start(settings.host, settings.port) if settings.zeroconf else None

    async def __del__(self) -> None:
        announcement = getattr(self, "announcement", None)  # None also where __init__ failed before it
        if announcement is not None:
            await announcement.close()

    def serving_warnings(self) -> tuple[str, ...]:
        return self.warnings

    def check_health(self) -> None:
        """Serve replaces the replica if its listener has stopped."""
        if not self.listener.serving:
            raise RuntimeError("the Wyoming listener has stopped")
