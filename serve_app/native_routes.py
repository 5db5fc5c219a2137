"""The native speech endpoint, `/v1/tts`: sampling options, a seed, instructions and cross-lingual voices."""

from fastapi import Request
from fastapi.responses import Response

from engine.llm.sampling import SamplingOptions
from engine.runtime.pipeline import SynthesisRequest
from serve_app.api import api
from serve_app.schemas import TTSRequest
from serve_app.synthesis import Synthesis


class NativeRoutes(Synthesis):
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
