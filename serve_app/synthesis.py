"""The synthesis path every speech route shares, held once by the ingress replica and given to each route group: a
request is checked, encoded by the `Encoder` deployment (CPU) and decoded by the `Decoder` deployment: short texts
sentence-parallel through its batched whole-utterance path, long texts and streaming requests sentence by sentence
through its batched streaming path, which starts on the first sentence while the encoder encodes the others. The audio
goes out whole, streamed, or as OpenAI's SSE events."""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponse, DeploymentResponseGenerator

from deployments.encoder import ModelInfo, SentencePlan
from engine.errors import InvalidInputError
from engine.families import models_following_instructions
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.registry import Caller, is_voice_id
from observability.http import SynthesisTimer, endpoint_of, request_id_of
from serve_app.audio import AudioFormat, audio_format
from serve_app.errors import REPLICA_LOST, SERVE_UNAVAILABLE, unavailable_error
from serve_app.guard import check_voice_name
from serve_app.request_args import OPENAI_TTS_MODELS, LimitsArgs, OpenAIArgs
from serve_app.responses import SSE_MEDIA_TYPE, OutputAudio, encoded_stream, iter_once, speech_usage, sse_body
from serve_app.routing import DecoderRouter
from serve_app.tenancy import caller_of
from serve_app.voice_names import CatalogVoice, mapped_voice, openai_voice_table

logger = logging.getLogger("ray.serve")

Mode = Literal["whole", "stream", "sse"]
# What a request asks for: a mode, or "audio" (OpenAI's default): streamed where its format and the model's family (at
# its speed) can stream, else whole.
Asked = Literal["whole", "stream", "sse", "audio"]
REROUTE_BACKOFF_S = 1.0  # between two tries of a stream whose decoder replica was lost (Serve replaces it in ~10 s)
# How long a stream whose decoder replica was lost before its first audio is sent again, then answered 503: it covers
# Ray declaring a lost node dead and a CPU replacement's start (10-24 s in the node-loss test, docs/reliability.md);
# a replacement that waits for a new GPU node (minutes) comes after it.
REROUTE_S = 30.0


def instructions_refusal(info: ModelInfo, voice: str) -> str | None:
    """Why the served model cannot follow instructions in `voice` (a built-in speaker or registered voice id, as
    resolved); None where it can: CosyVoice2 and 3 follow them in any voice with a stored prompt (instruct2), which
    registered voices, provisioned ones and the default voice have and built-in speakers lack."""
    support = info.instructions  # the model family's answer (engine.families)
    if support == "none":
        return f"the model {info.model!r} cannot follow instructions: only {models_following_instructions()} can"
    if support == "registered_voices" and voice in info.voices:
        return (
            f"{info.family} follows instructions in a registered (cloned) voice only: register one with POST "
            f"/v1/voices and use its id instead of the built-in speaker {voice!r}"
        )
    return None


def check_follows_instructions(info: ModelInfo, voice: str) -> None:
    """InvalidInputError (400) for instructions the served model cannot follow with `voice`."""
    refusal = instructions_refusal(info, voice)
    if refusal is not None:
        raise InvalidInputError(refusal)


def check_streams(info: ModelInfo, speed: float) -> None:
    """InvalidInputError (400) for a streamed request that the model's family cannot stream (at this speed)."""
    if not info.streaming:
        raise InvalidInputError(f"{info.family} models cannot stream yet: send the request with stream false")
    if not info.streams_at(speed):
        raise InvalidInputError(
            f"{info.family} streams at speed 1.0 only, as the official code: send speed 1.0, or the request "
            "with stream false"
        )


@dataclass(frozen=True)
class Delivery:
    """How a synthesis is answered, decided once per request (`delivery`)."""

    mode: Mode  # the whole file, a streamed body, or SSE events
    format: AudioFormat
    streamed: bool  # the audio goes out as it is decoded (else once it is whole: one SSE event at the end)


def delivery(asked: Asked, format_name: str, info: ModelInfo, speed: float) -> Delivery:
    """How a request that asks for `asked` in `format_name` at `speed` is answered; InvalidInputError (400) for a
    format unknown here, and for a "stream" the format or the model's family (at this speed) cannot make."""
    fmt = audio_format(format_name, streaming=asked == "stream")
    if asked == "stream":
        check_streams(info, speed)
    can_stream = fmt.streamable and info.streams_at(speed)
    mode: Mode = ("stream" if can_stream else "whole") if asked == "audio" else asked
    return Delivery(mode, fmt, streamed=mode != "whole" and can_stream)


def usage_of(timer: SynthesisTimer, input_tokens: int, info: ModelInfo) -> dict[str, int]:
    """The usage of a synthesis whose audio the timer counted."""
    return speech_usage(input_tokens, timer.samples / timer.sample_rate, info.speech_tokens_per_s)


async def call(make_call: Callable[[], Awaitable[Any]]) -> Any:
    """Await a call to another deployment, retried once if its replica died or its result was lost with the replica's
    node (decodes are seeded, so the retry gives the same audio); Serve's overload errors become JSON 503s."""
    try:
        try:
            return await make_call()
        except REPLICA_LOST as exc:
            logger.warning("a replica died during a call (%s); retrying it once", type(exc).__name__)
            return await make_call()
    except (*REPLICA_LOST, *SERVE_UNAVAILABLE) as exc:  # the retry failed too, or overload: 503
        raise unavailable_error(exc) from exc


class Synthesis:
    """The ingress replica's way to the encoder and the decoders, and the checks, voices and audio every speech route
    shares; each route group holds this one."""

    def __init__(
        self,
        encoder: DeploymentHandle,
        router: DecoderRouter,
        model_name: str,
        limits: LimitsArgs,
        openai: OpenAIArgs,
    ) -> None:
        self.encoder = encoder
        self.router = router
        self.model_name = model_name
        # the served model, then its aliases: what `model` may name
        self.model_names = (model_name, *(alias for alias in OPENAI_TTS_MODELS if alias != model_name))
        self.limits = limits
        self.openai = openai
        self._info: ModelInfo | None = None

    async def model_info(self) -> ModelInfo:
        """The served model, asked once from an encoder replica (a route reads it once per request)."""
        if self._info is None:
            self._info = await call(self.encoder.info.remote)
        return self._info

    async def voice_catalog(self, caller: Caller, info: ModelInfo) -> tuple[CatalogVoice, ...]:
        """The voices `caller` may use, each name once: the built-in speakers, the OpenAI voice names this model
        answers (the app args' table, the names of registered voices), then the registered voices `caller` sees (the
        key's own and the shared ones; by id, shown by name)."""
        registered = await call(partial(self.encoder.list_voices.remote, caller))
        voices = {name: CatalogVoice(name, name) for name in info.voices}
        table = openai_voice_table(self.openai.voices, info.voices, info.default_voice)
        for name, target in table.items():
            voices.setdefault(name, CatalogVoice(name, f"{name} (OpenAI's name for {target})"))
        for record in registered:
            name = record.get("openai_name")
            if name:
                voices.setdefault(name, CatalogVoice(name, f"{name} (OpenAI's name for {record['id']})"))
        for record in registered:
            voices.setdefault(record["id"], CatalogVoice(record["id"], record["name"]))
        return tuple(voices.values())

    async def resolve_voice(self, voice: str, caller: Caller, info: ModelInfo) -> str:
        """A built-in speaker or registered voice id as is; an OpenAI name through the app args' table, else the
        voice registered with that `openai_name` that `caller` hears for it (`VoiceRegistry.named`), else the
        default voice (a model without built-in speakers)."""
        built_in = info.voices
        if (
            voice not in built_in
            and not is_voice_id(voice)
            and voice not in openai_voice_table(self.openai.voices, built_in)
        ):
            named = await call(partial(self.encoder.named_voice.remote, voice, caller))
            if named is not None:
                return named
        return mapped_voice(voice, self.openai.voices, built_in, info.default_voice)

    async def respond(
        self,
        request: SynthesisRequest,
        answer: Delivery,
        info: ModelInfo,
        http: Request,
        output_rate: int | None = None,
    ) -> Response:
        """Check, encode, decode along the path `answer` calls for, and encode the audio at `output_rate` (None: the
        model's rate), which the `X-Sample-Rate` header says."""
        request_id = request_id_of(http.scope)
        self.check_text(request.text)
        request = self.checked(request, info)
        caller = caller_of(http.scope)
        mode, sample_rate = answer.mode, info.sample_rate
        output = OutputAudio(answer.format, sample_rate, output_rate or sample_rate)
        long_and_streams = len(request.text) > self.limits.long_text_chars and info.streams_at(request.speed)
        if not answer.streamed and not long_and_streams:
            segments: list[EncodedSegment] = await call(
                partial(self.encoder.encode.remote, request, request_id, caller)
            )
            timer = SynthesisTimer(endpoint_of(http.scope), mode, sample_rate)
            logger.info("synthesis of %d segment(s), %s", len(segments), mode, extra={"request_id": request_id})
            decoder = self.router.handle()
            decoded = (call(partial(decoder.synthesize.remote, s, request_id)) for s in segments)
            audio = np.concatenate(await asyncio.gather(*decoded))
            input_tokens = sum(segment.text_len for segment in segments)
            return self.whole_response(
                audio, output, mode, timer, request_id, partial(usage_of, timer, input_tokens, info)
            )

        # The streaming path: the first sentence decodes while the encoder encodes the others.
        first, plan = await call(partial(self.encoder.encode_first.remote, request, request_id, caller))
        timer = SynthesisTimer(endpoint_of(http.scope), mode, sample_rate)
        logger.info("synthesis of %d segment(s), %s", plan.num_segments, mode, extra={"request_id": request_id})
        usage = partial(usage_of, timer, sum(len(text.text) for text in plan.texts), info)
        if not answer.streamed:
            audio = np.concatenate([chunk async for chunk in self.stream_audio(first, plan, request_id)])
            return self.whole_response(audio, output, mode, timer, request_id, usage)
        chunks = timer.measure(self.stream_audio(first, plan, request_id))
        first_chunk = await anext(chunks, None)  # errors up to the first chunk still get their HTTP status
        encoded = encoded_stream(output.stream_encoder(), first_chunk, chunks, request_id)
        if mode == "sse":
            return StreamingResponse(
                sse_body(encoded, request_id, usage), media_type=SSE_MEDIA_TYPE, headers=output.headers
            )
        return StreamingResponse(encoded, media_type=answer.format.media_type, headers=output.headers)

    def check_text(self, text: str, what: str = "the input text") -> None:
        """InvalidInputError (400) for an empty text or one over `limits.max_input_chars`."""
        if not text.strip():
            raise InvalidInputError(f"{what} is empty")
        self.check_length(text, what)

    def check_length(self, text: str, what: str = "the input text") -> None:
        """InvalidInputError (400) for a text over `limits.max_input_chars`."""
        if len(text) > self.limits.max_input_chars:
            raise InvalidInputError(f"{what} has {len(text)} characters; the limit is {self.limits.max_input_chars}")

    @staticmethod
    def checked(request: SynthesisRequest, info: ModelInfo) -> SynthesisRequest:
        """The request's voice name and instructions checked against the served model, with its seed drawn (its text
        is `check_text`'s, its format and streaming `delivery`'s)."""
        check_voice_name(request.voice)
        if request.instruct_text is not None:
            check_follows_instructions(info, request.voice)
        return request.validated()

    @staticmethod
    def whole_response(
        audio: np.ndarray,
        output: OutputAudio,
        mode: Mode,
        timer: SynthesisTimer,
        request_id: str,
        usage: Callable[[], dict[str, int]],
    ) -> Response:
        """The whole file, in the body or (sse) in one event."""
        body = output.encode(audio)
        timer.audio(audio)
        timer.done()
        if mode == "sse":
            sse = sse_body(iter_once(body), request_id, usage)
            return StreamingResponse(sse, media_type=SSE_MEDIA_TYPE, headers=output.headers)
        return Response(body, media_type=output.format.media_type, headers=output.headers)

    async def stream_audio(
        self, first: list[EncodedSegment], plan: SentencePlan, request_id: str
    ) -> AsyncIterator[np.ndarray]:
        """Audio chunks of the plan's sentences in order, through the decoder's streaming path (which ends the request
        at its ceilings: `limits.max_stream_s`, `limits.max_audio_s`): `first` (its first sentences, encoded) at once,
        the others as the encoder encodes them meanwhile."""
        rest = None
        try:
            later = []
            if len(first) < plan.num_segments:
                rest = self.encoder.encode_planned.remote(plan, len(first), request_id)
                # An ObjectRef, which the decoder awaits: a DeploymentResponse passes only as a top-level argument,
                # which Serve resolves before the call.
                later = [await rest._to_object_ref()]

            # All sentences in one call: the decoder pipelines them (the next one generates while this one vocodes).
            def decode_call() -> DeploymentResponseGenerator:
                return self.router.handle().stream.options(stream=True).remote(first, request_id, later)

            async with contextlib.aclosing(self.rerouted(decode_call, request_id)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except SERVE_UNAVAILABLE as exc:
            raise unavailable_error(exc) from exc
        finally:  # a no-op for a finished call; it stops the encoder's work if the client left
            if rest is not None:
                _cancel(rest)

    async def rerouted(
        self, call: Callable[[], DeploymentResponseGenerator], request_id: str
    ) -> AsyncIterator[np.ndarray]:
        """The audio chunks of the streaming decoder call that `call()` makes. A lost replica (or, with its node, the
        chunks it had made) costs a call that sent nothing yet nothing but time: it is made again, to another replica
        or the replacement (whose queue the other re-sent calls may fill for a while), until `REROUTE_S`; one
        that has sent audio cannot be resumed (503). A full queue at the first try is overload: 503 at once. The call
        is cancelled when its chunks are left unread (the client left)."""
        loop = asyncio.get_running_loop()
        reroute_until = loop.time() + REROUTE_S
        lost = False  # a decoder replica was lost under this call before its first audio
        while True:
            response = call()
            started = False
            try:
                async for chunk in response:
                    started = True
                    yield chunk
                return
            except (*REPLICA_LOST, *SERVE_UNAVAILABLE) as exc:
                overload = isinstance(exc, BackPressureError) and not lost
                if started or overload or loop.time() >= reroute_until:
                    raise unavailable_error(exc) from exc
                lost = True
                logger.warning(
                    "the decoder replica was lost before this stream's first audio (%s); sending it again",
                    type(exc).__name__,
                    extra={"request_id": request_id},
                )
                await asyncio.sleep(REROUTE_BACKOFF_S)
            finally:
                _cancel(response)


def _cancel(call: DeploymentResponse | DeploymentResponseGenerator) -> None:
    """Cancel a Serve call: a no-op once it ended; it stops the replica's work for a client that left. Cancelling a
    call that failed re-raises its error (Serve's BackPressureError: a plain-text 503), which would replace the
    translated one on its way out."""
    with contextlib.suppress(Exception):
        call.cancel()
