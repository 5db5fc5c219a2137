"""OpenAI's speech endpoint, `/v1/audio/speech`."""

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.runtime.pipeline import SynthesisRequest
from serve_app.api import api
from serve_app.audio import audio_format
from serve_app.errors import UnknownModelError
from serve_app.schemas import SpeechRequest
from serve_app.synthesis import Mode, Synthesis, streams_at


def openai_mode(stream_format: str, response_format: str, info: dict[str, Any], speed: float) -> Mode:
    """How an OpenAI speech request is answered: "sse" events, else a streamed body ("stream", OpenAI's default),
    or the whole file where the format, or the model's family at this speed, cannot stream."""
    if stream_format == "sse":
        return "sse"
    return "stream" if audio_format(response_format).streamable and streams_at(info, speed) else "whole"


class OpenAIRoutes(Synthesis):
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
