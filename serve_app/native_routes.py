"""The native speech endpoint, `/v1/tts`: sampling options, a seed, instructions and cross-lingual voices."""

from fastapi import Request
from fastapi.responses import Response

from engine.errors import InvalidInputError
from engine.llm.sampling import SamplingOptions
from engine.runtime.synthesis_request import SynthesisRequest
from serve_app.api import api
from serve_app.schemas import TTSRequest
from serve_app.synthesis import Synthesis
from serve_app.tenancy import caller_of


class NativeRoutes(Synthesis):
    async def default_voice(self) -> str:
        """The model's first built-in speaker; for a model that has none (CosyVoice3's official models) the default
        voice provisioned for it (app args `default_voice`), else InvalidInputError."""
        info = await self.model_info()
        if info["voices"]:
            return info["voices"][0]
        if info["default_voice"] is not None:
            return info["default_voice"]
        raise InvalidInputError(
            "this model has no built-in speakers: pass `voice`, the id of a registered voice (POST /v1/voices)"
        )

    @api.post("/v1/tts")
    async def tts(self, body: TTSRequest, http: Request) -> Response:
        voice = (
            await self.resolve_voice(body.voice, caller_of(http.scope)) if body.voice else await self.default_voice()
        )
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
        return await self.respond(request, body.format, "stream" if body.stream else "whole", http)
