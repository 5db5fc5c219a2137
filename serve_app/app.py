"""The FastAPI ingress and the application builder `build_app(args)`.

Requests are validated here, encoded by the `Encoder` deployment (CPU) and decoded by the `Decoder`
deployment: short texts sentence-parallel through its batched whole-utterance path, long texts and
streaming requests sentence by sentence through its batched streaming path, which starts on the first
sentence while the encoder encodes the others.
"""

import asyncio
import base64
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve import Application
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from autoscaling.policy import ScalingRules, cpu_fallback_autoscaling_config
from deployments.decoder import Decoder
from deployments.encoder import Encoder, VoiceCloningConfig, VoiceCloningNotConfiguredError
from engine.errors import CosyVoiceError, InvalidInputError, UnavailableError, UnknownVoiceError
from engine.families.cosyvoice1 import INSTRUCT_MODEL_MARK
from engine.llm.sampling import SamplingOptions
from engine.runtime.pipeline import EncodingPlan, SynthesisRequest
from engine.runtime.segment import EncodedSegment
from engine.voices.cloning import PromptAudioLimits
from engine.voices.registry import is_voice_id
from observability import STRUCTURED_LOGGING
from observability.http import RequestObservability, SynthesisTimer, endpoint_of, request_id_of
from serve_app.args import AppArgs, LimitsArgs, OpenAIArgs, SecurityArgs
from serve_app.audio import FORMATS, AudioFormat, StreamEncoder, audio_format, encode_audio, stream_encoder
from serve_app.guard import (
    BodyTimeouts,
    GuardSettings,
    RequestGuard,
    browser_rules,
    check_voice_name,
    configure_guard,
    load_api_keys,
    load_keys,
    serving_warnings,
)
from serve_app.routing import CPU_DECODER, GPU_DECODER, DecoderRouter
from serve_app.schemas import SpeechRequest, TTSRequest
from serve_app.tenancy import KeyTenancy, TenancySettings, caller_of, configure_tenancy

logger = logging.getLogger("ray.serve")

Mode = Literal["whole", "stream", "sse"]
Chunk = np.ndarray | None  # the first audio chunk of a stream, None when the stream had no audio
SSE_MEDIA_TYPE = "text/event-stream"


class UnknownModelError(CosyVoiceError):
    http_status = 404


DEFAULT_RETRY_AFTER_S = 1.0  # where Serve gives none (a lost replica, no backpressure_config)
REROUTE_BACKOFF_S = 1.0  # between two tries of a stream whose decoder replica was lost (Serve replaces it in ~10 s)


class ServiceUnavailableError(UnavailableError):
    """A full queue (backpressure) or a lost replica: answered 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = DEFAULT_RETRY_AFTER_S if retry_after_s is None else retry_after_s


class UploadTooLargeError(CosyVoiceError):
    """A voice upload over `limits.max_prompt_audio_bytes`."""

    http_status = 413


VOICES_PATH = "/v1/voices"
HEALTH_MAX_AGE_S = 1.0
# Room for the multipart framing and the text fields around the audio of a voice upload (POST /v1/voices).
UPLOAD_FORM_OVERHEAD_BYTES = 64 << 10


# Raised by deployment handles; Serve answers the first two itself in plain text unless they are translated.
SERVE_UNAVAILABLE = (BackPressureError, DeploymentUnavailableError)


def unavailable_error(exc: BaseException) -> ServiceUnavailableError | None:
    """The 503 for Serve's overload and replica-failure errors, None for anything else."""
    if isinstance(exc, BackPressureError):
        return ServiceUnavailableError(f"the server is at capacity ({exc.message}); retry later", exc.retry_after_s)
    if isinstance(exc, DeploymentUnavailableError):
        return ServiceUnavailableError(f"no replica can take the request ({exc.message}); retry later")
    if isinstance(exc, RayActorError):
        return ServiceUnavailableError("a replica failed while serving this request; retry")
    return None


def error_body(status: int, message: str, code: str) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code, "param": None}}


def engine_error(exc: BaseException) -> CosyVoiceError | None:
    """The engine error behind `exc`, looking through Ray's wrapping of errors raised in other replicas."""
    while isinstance(exc, RayTaskError):
        exc = exc.cause
    return exc if isinstance(exc, CosyVoiceError) else unavailable_error(exc)


def error_payload(exc: BaseException, request_id: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI-shaped body) for an exception. A 500 says only "internal error" and the request id,
    never what failed inside: that goes to the log line, with the same id and the traceback."""
    error = engine_error(exc)
    status = 500 if error is None else error.http_status
    code = "internal_error" if error is None else type(error).__name__  # a class name tells no internals
    if status == 500:
        logger.error("internal error", exc_info=exc, extra={"request_id": request_id})
        return 500, error_body(500, f"internal error (request id {request_id})", code)
    assert error is not None
    message = error.message if status < 500 else f"{error.message} (request id {request_id})"
    return status, error_body(status, message, code)


def error_response(exc: BaseException, request_id: str) -> JSONResponse:
    status, body = error_payload(exc, request_id)
    error = engine_error(exc)
    headers = None
    if isinstance(error, UnavailableError):  # the engine's (a failed decoder loop) has no retry_after_s of its own
        retry_after_s = getattr(error, "retry_after_s", DEFAULT_RETRY_AFTER_S)
        headers = {"Retry-After": str(max(0, math.ceil(retry_after_s)))}
    return JSONResponse(body, status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for item in exc.errors():
        if item["type"] == "json_invalid":
            return f"malformed JSON body: {item.get('ctx', {}).get('error', item['msg'])}"
        where = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        parts.append(f"{where}: {item['msg']}" if where else item["msg"])
    return "invalid request: " + "; ".join(parts)


api = FastAPI(title="cosyvoice-serve", description="CosyVoice text-to-speech on Ray Serve")
# The try-it page (GET /) and its script and style: plain files, no build step.
STATIC_DIR = Path(__file__).parent / "static"
api.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


@api.exception_handler(RequestValidationError)
async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(error_body(400, validation_message(exc), "invalid_request"), status_code=400)


@api.exception_handler(HTTPException)
async def _on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(exc.status_code, str(exc.detail), "http_error"), status_code=exc.status_code)


# CosyVoiceError and a lost replica are handled inside the middleware below, which thus counts the status the client
# gets (503 for a lost replica); what only the `Exception` handler takes is answered outside it, as 500.
@api.exception_handler(CosyVoiceError)
@api.exception_handler(RayActorError)
@api.exception_handler(Exception)
async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc, request.scope.get("state", {}).get("request_id", "unknown"))


def _reject_request_id(message: str) -> JSONResponse:
    return JSONResponse(error_body(400, message, "invalid_request_id"), status_code=400)


# Each key's identity and in-flight limit, inside the guard: with keys on, only valid keys reach it.
api.add_middleware(KeyTenancy, error_body=error_body)
# API keys and the body size limit; added before the next, so it runs inside the observability middleware (401s are
# counted).
api.add_middleware(RequestGuard, error_body=error_body)
api.add_middleware(RequestObservability, reject=_reject_request_id)


# Module-level helpers of the ingress must be defined above it: `serve.deployment` pickles the class (and the globals
# its methods use) when it is decorated.
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


def mapped_voice(voice: str, table: dict[str, str], built_in: list[str]) -> str:
    """A built-in speaker or registered voice as is; an OpenAI voice name (a key of `table`, the app args'
    `openai.voices`) as the voice it stands for, which must be a built-in speaker or a registered voice id."""
    if voice in built_in or voice not in table:
        return voice
    target = table[voice]
    if target not in built_in and not is_voice_id(target):
        raise UnknownVoiceError(
            f"voice {voice!r} stands for {target!r} (openai.voices), which this model does not have; its voices: "
            f"{', '.join(built_in) or 'none'}"
        )
    return target


def check_follows_instructions(info: dict[str, Any], voice: str) -> None:
    """InvalidInputError (400) for instructions the served model cannot follow with `voice`."""
    support = info["instructions"]  # the model family's answer (engine.families)
    if support == "none":
        raise InvalidInputError(
            f"the model {info['model']!r} cannot follow instructions: only CosyVoice v1 {INSTRUCT_MODEL_MARK} models "
            "and CosyVoice2 or later models (with a registered voice) can"
        )
    if support == "registered_voices" and voice in info["voices"]:
        raise InvalidInputError(
            f"{info['family']} follows instructions in a registered (cloned) voice only: register one with POST "
            f"/v1/voices and use its id instead of the built-in speaker {voice!r}"
        )


def streams_at(info: dict[str, Any], speed: float) -> bool:
    """Whether the model's family streams a request at `speed` (CosyVoice3, as the official code, at 1.0 only)."""
    return info["streaming"] and (speed == 1.0 or info["streaming_speed"])


def openai_mode(stream_format: str, response_format: str, info: dict[str, Any], speed: float) -> Mode:
    """How an OpenAI speech request is answered: "sse" events, else a streamed body ("stream", OpenAI's default),
    or the whole file where the format, or the model's family at this speed, cannot stream."""
    if stream_format == "sse":
        return "sse"
    return "stream" if audio_format(response_format).streamable and streams_at(info, speed) else "whole"


def check_streams(info: dict[str, Any], speed: float) -> None:
    """InvalidInputError (400) for a streamed request that the model's family cannot stream (at this speed)."""
    if not info["streaming"]:
        raise InvalidInputError(f"{info['family']} models cannot stream yet: send the request with stream false")
    if not streams_at(info, speed):
        raise InvalidInputError(
            f"{info['family']} streams at speed 1.0 only, as the official code: send speed 1.0, or the request "
            "with stream false"
        )


def serve_http_host() -> str | None:
    """The host Serve's HTTP proxies bind (`http_options.host`), from the controller; None where it is unknown."""
    try:
        # Ray 2.60 has no public getter for it; serve.status() goes through the same client.
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.host
    except Exception as exc:
        logger.warning("could not read Serve's HTTP host (%s): Host checks accept the loopback names only", exc)
        return None


@serve.deployment(name="TTSIngress", logging_config=STRUCTURED_LOGGING)
@serve.ingress(api)
class TTSIngress:
    def __init__(
        self,
        encoder: DeploymentHandle,
        decoder: DeploymentHandle,
        model_name: str,
        limits: LimitsArgs,
        security: SecurityArgs | None = None,
        openai: OpenAIArgs | None = None,
        decoder_cpu: DeploymentHandle | None = None,
        routing_poll_s: float = 2.0,
        gpu_rules: ScalingRules | None = None,
    ):
        self.encoder = encoder
        self.model_name = model_name
        self.openai = openai or OpenAIArgs()
        self.model_names = (model_name, *(alias for alias in self.openai.model_aliases if alias != model_name))
        self.limits = limits
        self._info: dict[str, Any] | None = None
        upload_limit = max(limits.max_body_bytes, limits.max_prompt_audio_bytes + UPLOAD_FORM_OVERHEAD_BYTES)
        security = security or SecurityArgs()
        keys = load_api_keys(security)
        admin_keys = load_keys(security.admin_keys, security.admin_keys_env)
        keys_on = bool(keys + admin_keys)
        bound_host = serve_http_host()
        self.serving_warnings = serving_warnings(security, bound_host, keys_on)
        for warning in self.serving_warnings:
            logger.warning(warning)
        configure_guard(
            GuardSettings(
                keys + admin_keys,
                limits.max_body_bytes,
                {VOICES_PATH: upload_limit},
                body_timeouts=BodyTimeouts(limits.body_read_timeout_s, limits.body_read_deadline_s),
                browser=browser_rules(security, bound_host, keys_on),
            )
        )
        configure_tenancy(
            TenancySettings(
                keys_on=keys_on,
                admin_keys=admin_keys,
                max_concurrent_requests_per_key=limits.max_concurrent_requests_per_key,
                retry_after_s=limits.retry_after_s,
            )
        )
        decoders = {GPU_DECODER: decoder} | ({} if decoder_cpu is None else {CPU_DECODER: decoder_cpu})
        self.router = DecoderRouter(decoders, routing_poll_s, gpu_rules)
        self.router.start(serve.get_replica_context().app_name)

    async def model_info(self) -> dict[str, Any]:
        """Voices and sample rate, asked once from an encoder replica."""
        if self._info is None:
            self._info = await self.call(self.encoder.info.remote)
        return self._info

    @staticmethod
    async def call(make_call: Callable[[], Awaitable[Any]]) -> Any:
        """Await a call to another deployment, retried once if its replica died (decodes are seeded, so the
        retry gives the same audio); Serve's overload errors become JSON 503s."""
        try:
            try:
                return await make_call()
            except RayActorError as exc:
                logger.warning("a replica died during a call (%s); retrying it once", type(exc).__name__)
                return await make_call()
        except SERVE_UNAVAILABLE as exc:
            raise unavailable_error(exc) from exc

    # --- metadata ------------------------------------------------------------------------------------

    @api.get("/", include_in_schema=False)
    async def page(self) -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        """200 while the encoder and a decoder deployment (GPU or its CPU fallback) have a running replica, else 503.

        From the router's view, re-read when older than `HEALTH_MAX_AGE_S` (so a probe sees a replica's death within
        about a second: the view counts only replicas whose actor is alive), else the view it has.
        """
        try:
            await self.router.refresh_if_older(serve.get_replica_context().app_name, HEALTH_MAX_AGE_S)
        except Exception as exc:  # the last view stands
            logger.warning("could not re-read the replica counts for /healthz: %s", exc)
        ready = self.router.ready()
        polled_at = self.router.polled_at
        body = {
            "status": "ok" if ready else "unavailable",
            "running_replicas": self.router.running,
            "checked_s_ago": None if polled_at is None else round(time.monotonic() - polled_at, 3),
            "warnings": list(self.serving_warnings),  # e.g. serving beyond loopback without API keys
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        """The served model, then its aliases (openai.model_aliases): `model` may be any of them."""
        data = [{"id": name, "object": "model", "owned_by": "cosyvoice-serve"} for name in self.model_names]
        return {"object": "list", "data": data}

    @api.get(VOICES_PATH)
    async def voices(self, http: Request) -> dict[str, Any]:
        """Built-in speakers (`voices`), registered voices (`registered_voices`: records with their ids; with API
        keys, the key's own and the shared ones), the voice each OpenAI voice name stands for (`openai_voices`), and
        what the model and server can do."""
        info = await self.model_info()
        registered = await self.call(partial(self.encoder.list_voices.remote, caller_of(http.scope)))
        return {
            "voices": info["voices"],
            "sample_rate": info["sample_rate"],
            "formats": sorted(FORMATS),
            "stream_formats": [name for name, fmt in FORMATS.items() if fmt.streamable],
            "registered_voices": registered,
            "openai_voices": self.openai.voices,
            "voice_cloning": info["voice_cloning"],
            "instructions": info["instructions"],
        }

    @api.post(VOICES_PATH, status_code=201)
    async def register_voice(
        self,
        file: Annotated[
            UploadFile,
            File(
                description="a 1-30 s mono or stereo recording of the voice at 16, 22.05, 24, 32, 44.1 or 48 kHz "
                "(wav, flac, ogg, mp3)"
            ),
        ],
        transcript: Annotated[str, Form(description="what the recording says")],
        http: Request,
        name: Annotated[str | None, Form(description="a display name")] = None,
        shared: Annotated[bool, Form(description="usable by every API key (admin keys only)")] = False,
    ) -> dict[str, Any]:
        """Clone a voice from a short recording and its transcript; the returned `id` is usable as `voice` (with API
        keys, by this key only, unless an admin key makes it `shared`)."""
        if not (await self.model_info())["voice_cloning"]:
            raise VoiceCloningNotConfiguredError()
        limit = self.limits.max_prompt_audio_bytes
        audio = await file.read(limit + 1)  # the size is checked before anything decodes the file
        if len(audio) > limit:
            raise UploadTooLargeError(f"the audio file is larger than the limit of {limit} bytes")
        caller = caller_of(http.scope)
        return await self.call(partial(self.encoder.register_voice.remote, audio, transcript, name, caller, shared))

    @api.delete(VOICES_PATH + "/{voice_id}")
    async def delete_voice(self, voice_id: str, http: Request) -> dict[str, Any]:
        if not await self.call(partial(self.encoder.delete_voice.remote, voice_id, caller_of(http.scope))):
            raise UnknownVoiceError(f"no registered voice has the id {voice_id!r}")
        return {"id": voice_id, "object": "voice", "deleted": True}

    # --- synthesis -----------------------------------------------------------------------------------

    @api.post("/v1/audio/speech")
    async def openai_speech(self, body: SpeechRequest, http: Request) -> Response:
        """OpenAI's speech endpoint: `stream_format` "audio" streams the file as it is decoded (every format but
        flac), "sse" sends it as base64 `speech.audio.delta` events."""
        if body.model not in self.model_names:
            accepted = ", ".join(repr(name) for name in self.model_names)
            raise UnknownModelError(f"unknown model {body.model!r}; this server accepts {accepted}")
        request = SynthesisRequest(
            text=body.input,
            voice=await self.resolve_voice(body.voice_id),
            instruct_text=body.instructions,
            speed=body.speed,
        )
        mode = openai_mode(body.stream_format, body.response_format, await self.model_info(), body.speed)
        return await self.respond(request, body.response_format, mode, http)

    async def resolve_voice(self, voice: str) -> str:
        return mapped_voice(voice, self.openai.voices, (await self.model_info())["voices"])

    @api.post("/v1/tts")
    async def tts(self, body: TTSRequest, http: Request) -> Response:
        voice = await self.resolve_voice(body.voice) if body.voice else (await self.model_info())["voices"][0]
        sampling = SamplingOptions(**body.sampling.model_dump(exclude_none=True), seed=body.seed)
        request = SynthesisRequest(
            text=body.text,
            voice=voice,
            instruct_text=body.instruct_text,
            speed=body.speed,
            sampling=sampling,
            cross_lingual=body.cross_lingual,
        )
        return await self.respond(request, body.format, "stream" if body.stream else "whole", http)

    async def respond(self, request: SynthesisRequest, format_name: str, mode: Mode, http: Request) -> Response:
        """Validate, encode, decode along the path the request calls for, and encode the audio."""
        request_id = request_id_of(http.scope)
        if not request.text.strip():
            raise InvalidInputError("the input text is empty")
        if len(request.text) > self.limits.max_input_chars:
            raise InvalidInputError(
                f"the input text has {len(request.text)} characters; the limit is {self.limits.max_input_chars}"
            )
        check_voice_name(request.voice)
        fmt = audio_format(format_name, streaming=mode == "stream")
        info = await self.model_info()
        if mode == "stream":
            check_streams(info, request.speed)
        if request.instruct_text is not None:
            check_follows_instructions(info, request.voice)
        request = request.validated()
        caller = caller_of(http.scope)
        sample_rate = info["sample_rate"]
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
            return self.whole_response(np.concatenate(await asyncio.gather(*decoded)), fmt, mode, timer, request_id)

        # The streaming path: the first sentence decodes while the encoder encodes the others.
        first, plan = await self.call(partial(self.encoder.encode_first.remote, request, request_id, caller))
        timer = SynthesisTimer(endpoint_of(http.scope), mode, sample_rate)
        logger.info("synthesis of %d segment(s), %s", plan.num_segments, mode, extra={"request_id": request_id})
        if whole:
            audio = np.concatenate([chunk async for chunk in self.stream_audio(first, plan, request_id)])
            return self.whole_response(audio, fmt, mode, timer, request_id)
        chunks = timer.measure(self.stream_audio(first, plan, request_id))
        first_chunk = await anext(chunks, None)  # errors up to the first chunk still get their HTTP status
        encoded = encoded_stream(stream_encoder(fmt.name, sample_rate), first_chunk, chunks, request_id)
        if mode == "sse":
            return StreamingResponse(self.sse_body(encoded, request_id), media_type=SSE_MEDIA_TYPE)
        return StreamingResponse(encoded, media_type=fmt.media_type)

    def whole_response(
        self, audio: np.ndarray, fmt: AudioFormat, mode: Mode, timer: SynthesisTimer, request_id: str
    ) -> Response:
        """The whole file, in the body or (sse) in one event."""
        body = encode_audio(audio, timer.sample_rate, fmt.name)
        timer.audio(audio)
        timer.done()
        if mode == "sse":
            return StreamingResponse(self.sse_body(iter_once(body), request_id), media_type=SSE_MEDIA_TYPE)
        return Response(body, media_type=fmt.media_type)

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
                except (RayActorError, *SERVE_UNAVAILABLE) as exc:
                    # A stream that sent nothing yet lost nothing but time: it goes again, to another replica or
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

    @staticmethod
    async def sse_body(encoded: AsyncIterator[bytes], request_id: str) -> AsyncIterator[bytes]:
        """OpenAI's speech events: the file's bytes in base64 `speech.audio.delta` events, then `speech.audio.done`;
        a failure mid-stream ends it with an `error` event."""
        try:
            async for data in encoded:
                yield sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
        except Exception as exc:
            _, body = error_payload(exc, request_id)
            yield sse_event({"type": "error", **body})
            return
        yield sse_event({"type": "speech.audio.done"})


def queue_bound(max_queued_requests: int | None) -> int:
    """Serve's spelling of an unbounded queue is -1."""
    return -1 if max_queued_requests is None else max_queued_requests


def voice_cloning_config(args: AppArgs) -> VoiceCloningConfig | None:
    """The encoders' cloning setup; None (registering answers 501) without `voices_dir`."""
    models_dir = args.voice_models_path
    if args.voices_dir is None or models_dir is None:  # AppArgs refuses voices_dir without models
        return None
    # Absolute paths: the replicas need not share the caller's working directory.
    return VoiceCloningConfig(
        voices_dir=str(Path(args.voices_dir).resolve()),
        models_dir=str(models_dir.resolve()),
        max_voices=args.limits.max_voices,
        max_voices_per_key=args.limits.max_voices_per_key,
        prompt_audio=PromptAudioLimits(
            min_seconds=args.limits.min_prompt_audio_s,
            max_seconds=args.limits.max_prompt_audio_s,
            max_channels=args.limits.max_prompt_audio_channels,
            sample_rates=args.limits.prompt_audio_sample_rates,
        ),
    )


def replica_count(num_replicas: int, autoscaling_config: dict[str, Any] | None) -> dict[str, Any]:
    """Serve takes either a fixed replica count or an autoscaling config."""
    return {"num_replicas": num_replicas} if autoscaling_config is None else {"autoscaling_config": autoscaling_config}


def cpu_actor_options(num_cpus: float, resources: dict[str, float]) -> dict[str, Any]:
    """A CPU-only replica; custom `resources` pin it to the nodes that declare them (off the GPU nodes)."""
    return {"num_cpus": num_cpus, "num_gpus": 0} | ({"resources": resources} if resources else {})


# Beyond the longest stream: a replica being removed (scale-down, redeploy) first finishes what it serves.
SHUTDOWN_MARGIN_S = 30.0


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    """The Serve application: ingress -> Encoder (CPU) -> Decoder (GPU fraction or CPU)."""
    args = AppArgs.model_validate(args)
    # Bounded queues: a request over a bound is answered 503 with Retry-After instead of waiting without end.
    backpressure = {"retry_after_s": args.limits.retry_after_s}
    shutdown_s = args.limits.max_stream_s + SHUTDOWN_MARGIN_S
    encoder_scaling = args.encoder.autoscaling
    encoder = Encoder.options(
        **replica_count(args.encoder.num_replicas, encoder_scaling and encoder_scaling.model_dump(exclude_none=True)),
        max_ongoing_requests=args.encoder.max_ongoing_requests,
        max_queued_requests=queue_bound(args.encoder.max_queued_requests),
        backpressure_config=backpressure,
        ray_actor_options=cpu_actor_options(args.encoder.num_cpus, args.encoder.resources),
    ).bind(args.model, args.encoder.int8, args.limits.max_input_chars, voice_cloning_config(args))
    decoder_loop = {
        "max_audio_s": args.limits.max_audio_s,
        "max_request_s": args.limits.max_stream_s,
        "scheduling": args.scheduler.model_dump(),
    }
    decoder_scaling = args.decoder.autoscaling
    gpu_rules = decoder_scaling.scaling_rules() if decoder_scaling else None
    decoder = Decoder.options(
        **replica_count(args.decoder.num_replicas, decoder_scaling and decoder_scaling.serve_config()),
        max_ongoing_requests=args.decoder.ongoing_requests_limit,
        max_queued_requests=queue_bound(args.decoder.max_queued_requests),
        backpressure_config=backpressure,
        graceful_shutdown_timeout_s=shutdown_s,
        ray_actor_options={"num_cpus": args.decoder.num_cpus, "num_gpus": args.decoder.num_gpus},
    ).bind(
        args.model,
        use_gpu=args.decoder.num_gpus > 0,
        dtype=args.decoder.dtype,
        max_batch_size=args.decoder.max_batch_size,
        batch_wait_timeout_s=args.decoder.batch_wait_timeout_s,
        memory_budget_gb=args.decoder.memory_budget_gb,
        max_concurrent_batches=args.decoder.max_concurrent_batches,
        gpu_fraction=args.decoder.num_gpus,
        max_vocode_batch=args.decoder.max_vocode_batch,
        **decoder_loop,
    )
    fallback = args.decoder_cpu
    decoder_cpu = None
    if fallback.enabled:
        # The same Decoder class on CPU in fp32, scaled by its own policy (up while the GPU decoders may be at 0).
        decoder_cpu = Decoder.options(
            name=CPU_DECODER,
            max_ongoing_requests=fallback.max_ongoing_requests,
            max_queued_requests=queue_bound(fallback.max_queued_requests),
            backpressure_config=backpressure,
            graceful_shutdown_timeout_s=shutdown_s,
            autoscaling_config=fallback.autoscaling_config or cpu_fallback_autoscaling_config(gpu_rules),
            ray_actor_options=cpu_actor_options(fallback.num_cpus, fallback.resources),
        ).bind(
            args.model,
            use_gpu=False,
            dtype="float32",
            max_batch_size=fallback.max_batch_size,
            batch_wait_timeout_s=fallback.batch_wait_timeout_s,
            **decoder_loop,
        )
    return TTSIngress.options(
        num_replicas=args.ingress.num_replicas,
        max_ongoing_requests=args.ingress.max_ongoing_requests,
        max_queued_requests=queue_bound(args.ingress.max_queued_requests),
        backpressure_config=backpressure,
        graceful_shutdown_timeout_s=shutdown_s,
        ray_actor_options=cpu_actor_options(args.ingress.num_cpus, args.ingress.resources),
    ).bind(
        encoder,
        decoder,
        args.served_model_name or Path(args.model).name,
        args.limits,
        security=args.security,
        openai=args.openai,
        decoder_cpu=decoder_cpu,
        routing_poll_s=fallback.poll_interval_s,
        gpu_rules=gpu_rules,
    )


# The default application (tiny model, CPU), for `serve run serve_app:app` and `serve build serve_app:app`.
app = build_app(AppArgs())
