"""The native speech endpoint, `/v1/tts`: sampling options, a seed, instructions and cross-lingual voices."""

from fastapi import APIRouter, Request
from fastapi.responses import Response

from deployments.encoder import ModelInfo
from engine.errors import InvalidInputError
from engine.llm.sampling import SamplingOptions
from engine.runtime.synthesis_request import SynthesisRequest
from serve_app.schemas import TTSRequest
from serve_app.synthesis import Synthesis, delivery
from serve_app.tenancy import caller_of


def default_voice(info: ModelInfo) -> str:
    """The model's first built-in speaker; for a model that has none (CosyVoice3's official models) the default voice
    provisioned for it (app args `default_voice`), else InvalidInputError."""
    if info.voices:
        return info.voices[0]
    if info.default_voice is not None:
        return info.default_voice
    raise InvalidInputError(
        "this model has no built-in speakers: pass `voice`, the id of a registered voice (POST /v1/voices)"
    )


class NativeRoutes:
    """`/v1/tts`, on the replica's `Synthesis`."""

    def __init__(self, synthesis: Synthesis) -> None:
        self.synthesis = synthesis

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/tts", self.tts, methods=["POST"])
        return router

    async def tts(self, body: TTSRequest, http: Request) -> Response:
        info = await self.synthesis.model_info()
        caller = caller_of(http.scope)
        voice = await self.synthesis.resolve_voice(body.voice, caller, info) if body.voice else default_voice(info)
        sampling = SamplingOptions(**body.sampling.model_dump(exclude_none=True), seed=body.seed)
        request = SynthesisRequest(
            text=body.text,
            voice=voice,
            instruct_text=body.instruct_text,
            speed=body.speed,
            sampling=sampling,
            cross_lingual=body.cross_lingual,
            language=body.language,
        )
        answer = delivery("stream" if body.stream else "whole", body.format, info, body.speed)
        return await self.synthesis.respond(request, answer, info, http)
