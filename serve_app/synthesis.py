"""The synthesis path both speech endpoints share: a request is checked, encoded by the `Encoder` deployment (CPU)
and decoded by the `Decoder` deployment: short texts sentence-parallel through its batched whole-utterance path,
long texts and streaming requests sentence by sentence through its batched streaming path, which starts on the first
sentence while the encoder encodes the others. The audio goes out whole, streamed, or as OpenAI's SSE events."""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from ray.serve.exceptions import BackPressureError

from engine.errors import InvalidInputError, UnknownVoiceError
from engine.families import models_following_instructions
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import EncodingPlan, SynthesisRequest
from engine.voices.registry import Caller, is_voice_id
from observability.http import SynthesisTimer, endpoint_of, request_id_of
from serve_app.audio import AudioFormat, audio_format
from serve_app.errors import REPLICA_LOST, SERVE_UNAVAILABLE, unavailable_error
from serve_app.guard import check_voice_name
from serve_app.ingress_base import IngressBase
from serve_app.responses import SSE_MEDIA_TYPE, OutputAudio, encoded_stream, iter_once, speech_usage, sse_body
from serve_app.tenancy import caller_of

logger = logging.getLogger("ray.serve")

Mode = Literal["whole", "stream", "sse"]
REROUTE_BACKOFF_S = 1.0  # between two tries of a stream whose decoder replica was lost (Serve replaces it in ~10 s)


def openai_voice_table(table: dict[str, str], built_in: list[str], default_voice: str | None = None) -> dict[str, str]:
    """The OpenAI voice names the served model answers (`/v1/voices` shows them): the app args' table (with the
    voices provisioned at deploy) for a model with built-in speakers; for one without (CosyVoice3), the names that
    stand for a registered voice id, such as a provisioned voice's `openai_name`, and every other name of the table
    for the `default_voice` where one was provisioned (app args `default_voice`)."""
    if built_in:
        return dict(table)
    registered = {name: target for name, target in table.items() if is_voice_id(target)}
    return registered if default_voice is None else dict.fromkeys(table, default_voice) | registered


def mapped_voice(voice: str, table: dict[str, str], built_in: list[str], default_voice: str | None = None) -> str:
    """A built-in speaker or registered voice as is; an OpenAI voice name (a key of `table`, the app args'
    `openai.voices`) as the voice it stands for (`openai_voice_table`), which must be a built-in speaker or a
    registered voice id."""
    if voice in built_in or voice not in table:
        return voice
    answered = openai_voice_table(table, built_in, default_voice)
    if voice not in answered:
        raise UnknownVoiceError(
            f"voice {voice!r} is an OpenAI voice name, and this model has no built-in speakers: it stands for a voice "
            "only where the server provisions one for it (app args voices, with openai_name; the default voice, app "
            "args default_voice, with voices_dir) or openai.voices maps it to a registered voice id; use a registered "
            "voice's id (GET /v1/voices)"
        )
    target = answered[voice]
    if target not in built_in and not is_voice_id(target):
        raise UnknownVoiceError(
            f"voice {voice!r} stands for {target!r} (openai.voices), which this model does not have; its voices: "
            f"{', '.join(built_in) or 'none'}"
        )
    return target


def instructions_refusal(info: dict[str, Any], voice: str) -> str | None:
    """Why the served model cannot follow instructions in `voice` (a built-in speaker or registered voice id, as
    resolved); None where it can: CosyVoice2 and 3 follow them in any voice with a stored prompt (instruct2), which
    registered voices, provisioned ones and the default voice have and built-in speakers lack."""
    support = info["instructions"]  # the model family's answer (engine.families)
    if support == "none":
        return f"the model {info['model']!r} cannot follow instructions: only {models_following_instructions()} can"
    if support == "registered_voices" and voice in info["voices"]:
        return (
            f"{info['family']} follows instructions in a registered (cloned) voice only: register one with POST "
            f"/v1/voices and use its id instead of the built-in speaker {voice!r}"
        )
    return None


def check_follows_instructions(info: dict[str, Any], voice: str) -> None:
    """InvalidInputError (400) for instructions the served model cannot follow with `voice`."""
    refusal = instructions_refusal(info, voice)
    if refusal is not None:
        raise InvalidInputError(refusal)


def streams_at(info: dict[str, Any], speed: float) -> bool:
    """Whether the model's family streams a request at `speed` (CosyVoice3, as the official code, at 1.0 only)."""
    return info["streaming"] and (speed == 1.0 or info["streaming_speed"])


def check_streams(info: dict[str, Any], speed: float) -> None:
    """InvalidInputError (400) for a streamed request that the model's family cannot stream (at this speed)."""
    if not info["streaming"]:
        raise InvalidInputError(f"{info['family']} models cannot stream yet: send the request with stream false")
    if not streams_at(info, speed):
        raise InvalidInputError(
            f"{info['family']} streams at speed 1.0 only, as the official code: send speed 1.0, or the request "
            "with stream false"
        )


@dataclass(frozen=True)
class CatalogVoice:
    """A voice a caller may send, as the lists of clients show it (Open WebUI's `/v1/audio/voices`, Wyoming's
    `describe`)."""

    name: str  # what a client sends as `voice`
    description: str  # what a client's menu shows


class Synthesis(IngressBase):
    async def voice_catalog(self, caller: Caller) -> tuple[CatalogVoice, ...]:
        """The voices `caller` may use, each name once: the built-in speakers, the OpenAI voice names this model
        answers (the app args' table, the names of registered voices), then the registered voices `caller` sees (the
        key's own and the shared ones; by id, shown by name)."""
        info = await self.model_info()
        registered = await self.call(partial(self.encoder.list_voices.remote, caller))
        voices = {name: CatalogVoice(name, name) for name in info["voices"]}
        table = openai_voice_table(self.openai.voices, info["voices"], info["default_voice"])
        for name, target in table.items():
            voices.setdefault(name, CatalogVoice(name, f"{name} (OpenAI's name for {target})"))
        for record in registered:
            name = record.get("openai_name")
            if name:
                voices.setdefault(name, CatalogVoice(name, f"{name} (OpenAI's name for {record['id']})"))
        for record in registered:
            voices.setdefault(record["id"], CatalogVoice(record["id"], record["name"]))
        return tuple(voices.values())

    async def resolve_voice(self, voice: str, caller: Caller) -> str:
        """A built-in speaker or registered voice id as is; an OpenAI name through the app args' table, else the
        voice registered with that `openai_name` that `caller` hears for it (`VoiceRegistry.named`), else the
        default voice (a model without built-in speakers)."""
        info = await self.model_info()
        built_in = info["voices"]
        if (
            voice not in built_in
            and not is_voice_id(voice)
            and voice not in openai_voice_table(self.openai.voices, built_in)
        ):
            named = await self.call(partial(self.encoder.named_voice.remote, voice, caller))
            if named is not None:
                return named
        return mapped_voice(voice, self.openai.voices, built_in, info["default_voice"])

    async def respond(
        self, request: SynthesisRequest, format_name: str, mode: Mode, http: Request, output_rate: int | None = None
    ) -> Response:
        """Validate, encode, decode along the path the request calls for, and encode the audio at `output_rate`
        (None: the model's rate), which the `X-Sample-Rate` header says."""
        request_id = request_id_of(http.scope)
        self.check_text(request.text)
        request, fmt, info = await self.checked(request, format_name, mode)
        caller = caller_of(http.scope)
        sample_rate = info["sample_rate"]
        output = OutputAudio(fmt, sample_rate, output_rate or sample_rate, self.audio.bit_rate(fmt.name))
        streams = streams_at(info, request.speed)
        # whole, or sse of a format (or model, at this speed) that cannot stream: one event, at the end
        whole = mode == "whole" or not (fmt.streamable and streams)
        if whole and not (len(request.text) > self.limits.long_text_chars and streams):
            segments: list[EncodedSegment] = await self.call(
                partial(self.encoder.encode.remote, request, request_id, caller)
            )
            timer = SynthesisTimer(endpoint_of(http.scope), mode, sample_rate)
            logger.info("synthesis of %d segment(s), %s", len(segments), mode, extra={"request_id": request_id})
            decoder = self.router.handle()
            decoded = (self.call(partial(decoder.synthesize.remote, s, request_id)) for s in segments)
            audio = np.concatenate(await asyncio.gather(*decoded))
            input_tokens = sum(segment.text_len for segment in segments)
            return self.whole_response(audio, output, mode, timer, request_id, input_tokens)

        # The streaming path: the first sentence decodes while the encoder encodes the others.
        first, plan = await self.call(partial(self.encoder.encode_first.remote, request, request_id, caller))
        timer = SynthesisTimer(endpoint_of(http.scope), mode, sample_rate)
        logger.info("synthesis of %d segment(s), %s", plan.num_segments, mode, extra={"request_id": request_id})
        input_tokens = sum(len(text.text) for text in plan.texts)
        if whole:
            audio = np.concatenate([chunk async for chunk in self.stream_audio(first, plan, request_id)])
            return self.whole_response(audio, output, mode, timer, request_id, input_tokens)
        chunks = timer.measure(self.stream_audio(first, plan, request_id))
        first_chunk = await anext(chunks, None)  # errors up to the first chunk still get their HTTP status
        encoded = encoded_stream(output.stream_encoder(), first_chunk, chunks, request_id)
        if mode == "sse":
            usage = partial(self.usage_of, timer, input_tokens)
            body = sse_body(encoded, request_id, usage)
            return StreamingResponse(body, media_type=SSE_MEDIA_TYPE, headers=output.headers)
        return StreamingResponse(encoded, media_type=fmt.media_type, headers=output.headers)

    def check_text(self, text: str, what: str = "the input text") -> None:
        """InvalidInputError (400) for an empty text or one over `limits.max_input_chars`."""
        if not text.strip():
            raise InvalidInputError(f"{what} is empty")
        self.check_length(text, what)

    def check_length(self, text: str, what: str = "the input text") -> None:
        """InvalidInputError (400) for a text over `limits.max_input_chars`."""
        if len(text) > self.limits.max_input_chars:
            raise InvalidInputError(f"{what} has {len(text)} characters; the limit is {self.limits.max_input_chars}")

    async def checked(
        self, request: SynthesisRequest, format_name: str, mode: Mode
    ) -> tuple[SynthesisRequest, AudioFormat, dict[str, Any]]:
        """The request's options checked against the served model (voice name, format, streaming, instructions),
        with its seed drawn; its text is `check_text`'s."""
        check_voice_name(request.voice)
        fmt = audio_format(format_name, streaming=mode == "stream")
        info = await self.model_info()
        if mode == "stream":
            check_streams(info, request.speed)
        if request.instruct_text is not None:
            check_follows_instructions(info, request.voice)
        return request.validated(), fmt, info

    def usage_of(self, timer: SynthesisTimer, input_tokens: int) -> dict[str, int]:
        """The usage of a synthesis whose audio the timer counted."""
        assert self._info is not None  # read before any synthesis
        return speech_usage(input_tokens, timer.samples / timer.sample_rate, self._info["speech_tokens_per_s"])

    def whole_response(
        self,
        audio: np.ndarray,
        output: OutputAudio,
        mode: Mode,
        timer: SynthesisTimer,
        request_id: str,
        input_tokens: int,
    ) -> Response:
        """The whole file, in the body or (sse) in one event."""
        body = output.encode(audio)
        timer.audio(audio)
        timer.done()
        if mode == "sse":
            usage = partial(self.usage_of, timer, input_tokens)
            sse = sse_body(iter_once(body), request_id, usage)
            return StreamingResponse(sse, media_type=SSE_MEDIA_TYPE, headers=output.headers)
        return Response(body, media_type=output.format.media_type, headers=output.headers)

    async def stream_audio(
        self, first: list[EncodedSegment], plan: EncodingPlan, request_id: str
    ) -> AsyncIterator[np.ndarray]:
        """Audio chunks of the plan's sentences in order, through the decoder's streaming path (which ends the request
        at its ceilings: `limits.max_stream_s`, `limits.max_audio_s`): `first` (its first sentences, encoded) at once,
        the others as the encoder encodes them meanwhile."""
        loop = asyncio.get_running_loop()
        reroute_until = loop.time() + self.limits.reroute_s
        rest = response = None
        try:
            later = []
            if len(first) < plan.num_segments:
                rest = self.encoder.encode_planned.remote(plan, len(first), request_id)
                # An ObjectRef, which the decoder awaits: a DeploymentResponse passes only as a top-level argument,
                # which Serve resolves before the call.
                later = [await rest._to_object_ref()]
            lost = False  # a decoder replica was lost under this stream before its first audio
            while True:
                # All sentences in one call: the decoder pipelines them (the next one generates while this one
                # vocodes).
                response = self.router.handle().stream.options(stream=True).remote(first, request_id, later)
                started = False
                try:
                    async for chunk in response:
                        started = True
                        yield chunk
                    return
                except (*REPLICA_LOST, *SERVE_UNAVAILABLE) as exc:
                    # A lost replica (or, with its node, the chunks it had made): a stream that sent nothing yet lost
                    # nothing but time: it goes again, to another replica or
                    # the replacement (whose queue the other re-sent streams may fill for a while), until
                    # `limits.reroute_s`; one that has sent audio cannot be resumed. A full queue at the first try
                    # is overload: 503 at once.
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
        except SERVE_UNAVAILABLE as exc:
            raise unavailable_error(exc) from exc
        finally:  # no-ops for finished calls; they stop the decoder's and the encoder's work if the client left
            for call in (response, rest):
                if call is not None:
                    # Cancelling a call that failed re-raises its error (Serve's BackPressureError: a plain-text 503),
                    # which would replace the translated one on its way out.
                    with contextlib.suppress(Exception):
                        call.cancel()
