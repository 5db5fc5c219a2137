"""The FastAPI ingress and the application builder `build_app(args)`.

Requests are validated here, encoded by the `Encoder` deployment (CPU) and decoded by the `Decoder`
deployment: short texts sentence-parallel through its batched whole-utterance path, long texts and
streaming requests sentence by sentence through its batched streaming path.
"""

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayTaskError
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from deployments.decoder import Decoder
from deployments.encoder import Encoder
from engine.errors import CosyVoiceError, InvalidInputError
from engine.pipeline import EncodedSegment, SynthesisRequest
from engine.sampling import SamplingOptions
from serve_app.args import AppArgs, LimitsArgs
from serve_app.audio import FORMATS, audio_format, encode_audio, stream_prefix, to_pcm16
from serve_app.schemas import SpeechRequest, TTSRequest

logger = logging.getLogger("ray.serve")

Mode = Literal["whole", "stream", "sse"]
Chunk = np.ndarray | None  # the first audio chunk of a stream, None when the stream had no audio
SSE_MEDIA_TYPE = "text/event-stream"


class UnknownModelError(CosyVoiceError):
    http_status = 404


def error_body(status: int, message: str, code: str) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code, "param": None}}


def engine_error(exc: BaseException) -> CosyVoiceError | None:
    """The engine error behind `exc`, looking through Ray's wrapping of errors raised in other replicas."""
    while isinstance(exc, RayTaskError):
        exc = exc.cause
    return exc if isinstance(exc, CosyVoiceError) else None


def error_payload(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI-shaped body) for an exception; unexpected ones are logged as 500s."""
    error = engine_error(exc)
    if error is None:
        logger.exception("unexpected error", exc_info=exc)
        return 500, error_body(500, f"internal error: {exc}", "internal_error")
    return error.http_status, error_body(error.http_status, error.message, type(error).__name__)


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_payload(exc)
    return JSONResponse(body, status_code=status)


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for item in exc.errors():
        if item["type"] == "json_invalid":
            return f"malformed JSON body: {item.get('ctx', {}).get('error', item['msg'])}"
        where = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        parts.append(f"{where}: {item['msg']}" if where else item["msg"])
    return "invalid request: " + "; ".join(parts)


api = FastAPI(title="cosyvoice-serve", description="CosyVoice text-to-speech on Ray Serve")


@api.exception_handler(RequestValidationError)
async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(error_body(400, validation_message(exc), "invalid_request"), status_code=400)


@api.exception_handler(HTTPException)
async def _on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(exc.status_code, str(exc.detail), "http_error"), status_code=exc.status_code)


@api.exception_handler(Exception)
async def _on_error(_: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


def sse_event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


@serve.deployment(name="TTSIngress")
@serve.ingress(api)
class TTSIngress:
    def __init__(self, encoder: DeploymentHandle, decoder: DeploymentHandle, model_name: str, limits: LimitsArgs):
        self.encoder = encoder
        self.decoder = decoder
        self.model_name = model_name
        self.limits = limits
        self._info: dict[str, Any] | None = None

    async def model_info(self) -> dict[str, Any]:
        """Voices and sample rate, asked once from an encoder replica."""
        if self._info is None:
            self._info = await self.encoder.info.remote()
        return self._info

    # --- metadata ------------------------------------------------------------------------------------

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        """200 once both stages have a running replica, else 503."""
        app_name = serve.get_replica_context().app_name
        status = await asyncio.to_thread(serve.status)
        deployments = status.applications[app_name].deployments
        running = {name: deployments[name].replica_states.get("RUNNING", 0) for name in ("Encoder", "Decoder")}
        ready = all(running.values())
        body = {"status": "ok" if ready else "unavailable", "running_replicas": running}
        return JSONResponse(body, status_code=200 if ready else 503)

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "cosyvoice-serve"}]}

    @api.get("/v1/voices")
    async def voices(self) -> dict[str, Any]:
        info = await self.model_info()
        return {"voices": info["voices"], "sample_rate": info["sample_rate"], "formats": sorted(FORMATS)}

    # --- synthesis -----------------------------------------------------------------------------------

    @api.post("/v1/audio/speech")
    async def openai_speech(self, body: SpeechRequest) -> Response:
        if body.model != self.model_name:
            raise UnknownModelError(f"unknown model {body.model!r}; this server serves {self.model_name!r}")
        request = SynthesisRequest(
            text=body.input, voice=body.voice_id, instruct_text=body.instructions, speed=body.speed
        )
        mode: Mode = "sse" if body.stream_format == "sse" else "whole"
        return await self.respond(request, body.response_format, mode)

    @api.post("/v1/tts")
    async def tts(self, body: TTSRequest) -> Response:
        voice = body.voice or (await self.model_info())["voices"][0]
        sampling = SamplingOptions(**body.sampling.model_dump(exclude_none=True), seed=body.seed)
        request = SynthesisRequest(
            text=body.text, voice=voice, instruct_text=body.instruct_text, speed=body.speed, sampling=sampling
        )
        return await self.respond(request, body.format, "stream" if body.stream else "whole")

    async def respond(self, request: SynthesisRequest, format_name: str, mode: Mode) -> Response:
        """Validate, encode, decode along the path the request calls for, and encode the audio."""
        if not request.text.strip():
            raise InvalidInputError("the input text is empty")
        if len(request.text) > self.limits.max_input_chars:
            raise InvalidInputError(
                f"the input text has {len(request.text)} characters; the limit is {self.limits.max_input_chars}"
            )
        fmt = audio_format(format_name, streaming=mode != "whole")
        request = request.validated()
        segments: list[EncodedSegment] = await self.encoder.encode.remote(request)
        sample_rate = (await self.model_info())["sample_rate"]
        if mode == "whole":
            if len(request.text) > self.limits.long_text_chars:
                audio = np.concatenate([chunk async for chunk in self.stream_audio(segments)])
            else:
                audio = np.concatenate(await asyncio.gather(*(self.decoder.synthesize.remote(s) for s in segments)))
            return Response(encode_audio(audio, sample_rate, fmt.name), media_type=fmt.media_type)

        chunks = self.stream_audio(segments)
        first = await anext(chunks, None)  # errors up to the first chunk still get their HTTP status
        prefix = stream_prefix(fmt.name, sample_rate)
        if mode == "sse":
            return StreamingResponse(self.sse_body(prefix, first, chunks), media_type=SSE_MEDIA_TYPE)
        return StreamingResponse(self.audio_body(prefix, first, chunks), media_type=fmt.media_type)

    async def stream_audio(self, segments: list[EncodedSegment]) -> AsyncIterator[np.ndarray]:
        """Audio chunks of the segments in order, through the decoder's streaming path."""
        for segment in segments:
            response = self.decoder.stream.options(stream=True).remote(segment)
            try:
                async for chunk in response:
                    yield chunk
            finally:
                response.cancel()  # no-op when finished; stops the decoder's work if the client left

    @staticmethod
    async def audio_body(prefix: bytes, first: Chunk, rest: AsyncIterator[np.ndarray]) -> AsyncIterator[bytes]:
        yield prefix + (b"" if first is None else to_pcm16(first))
        try:
            async for chunk in rest:
                yield to_pcm16(chunk)
        except Exception as exc:
            # The status line is gone: abort the connection so the client sees a broken stream, not a short file.
            logger.error("stream failed after the first chunk: %s", exc)
            raise

    @staticmethod
    async def sse_body(prefix: bytes, first: Chunk, rest: AsyncIterator[np.ndarray]) -> AsyncIterator[bytes]:
        def delta(data: bytes) -> bytes:
            return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

        yield delta(prefix + (b"" if first is None else to_pcm16(first)))
        try:
            async for chunk in rest:
                yield delta(to_pcm16(chunk))
        except Exception as exc:
            _, body = error_payload(exc)
            yield sse_event({"type": "error", **body})
            return
        yield sse_event({"type": "speech.audio.done"})


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    """The Serve application: ingress -> Encoder (CPU) -> Decoder (GPU fraction or CPU)."""
    args = AppArgs.model_validate(args)
    encoder = Encoder.options(
        num_replicas=args.encoder.num_replicas,
        max_ongoing_requests=args.encoder.max_ongoing_requests,
        ray_actor_options={"num_cpus": args.encoder.num_cpus, "num_gpus": 0},
    ).bind(args.model, args.encoder.int8, args.limits.max_input_chars)
    decoder = Decoder.options(
        num_replicas=args.decoder.num_replicas,
        max_ongoing_requests=args.decoder.ongoing_requests_limit,
        ray_actor_options={"num_cpus": args.decoder.num_cpus, "num_gpus": args.decoder.num_gpus},
    ).bind(
        args.model,
        use_gpu=args.decoder.num_gpus > 0,
        dtype=args.decoder.dtype,
        max_batch_size=args.decoder.max_batch_size,
        batch_wait_timeout_s=args.decoder.batch_wait_timeout_s,
        memory_budget_gb=args.decoder.memory_budget_gb,
    )
    return TTSIngress.options(
        num_replicas=args.ingress.num_replicas,
        max_ongoing_requests=args.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": args.ingress.num_cpus},
    ).bind(encoder, decoder, args.served_model_name or Path(args.model).name, args.limits)


# The default application (tiny model, CPU), for `serve run serve_app:app` and `serve build serve_app:app`.
app = build_app(AppArgs())
