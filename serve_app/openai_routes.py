"""OpenAI's speech endpoint, `/v1/audio/speech`."""

import logging
import re
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.runtime.pipeline import SynthesisRequest
from engine.voices.registry import Caller
from serve_app.api import api
from serve_app.audio import OPENAI_SAMPLE_RATE, audio_format
from serve_app.errors import UnknownModelError
from serve_app.schemas import SpeechOptions, SpeechRequest
from serve_app.synthesis import Mode, Synthesis, streams_at
from serve_app.tenancy import caller_of

logger = logging.getLogger("ray.serve")

# OpenAI names dated snapshots after their model: gpt-4o-mini-tts-2025-12-15, tts-1-1106, tts-1-hd-1106.
SNAPSHOT_SUFFIX = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{4})$")
MAX_LOGGED_FIELDS = 64  # unknown field names logged, at most: a client cannot grow the set or flood the log


def served_model(name: str, served: str, aliases: tuple[str, ...]) -> str | None:
    """What a request's `model` stands for: the served model or one of its aliases, also an alias followed by a
    snapshot suffix; None for any other name."""
    if name == served or name in aliases:
        return name
    alias = SNAPSHOT_SUFFIX.sub("", name)
    return alias if alias != name and alias in aliases else None


def openai_mode(stream_format: str, response_format: str, info: dict[str, Any], speed: float) -> Mode:
    """How an OpenAI speech request is answered: "sse" events, else a streamed body ("stream", OpenAI's default),
    or the whole file where the format, or the model's family at this speed, cannot stream."""
    if stream_format == "sse":
        return "sse"
    return "stream" if audio_format(response_format).streamable and streams_at(info, speed) else "whole"


_logged_fields: set[str] = set()


def log_ignored_fields(body: SpeechRequest) -> None:
    """Log each unknown field name once (of the first MAX_LOGGED_FIELDS)."""
    for name in sorted(set(body.model_extra or ()) - _logged_fields):
        if len(_logged_fields) >= MAX_LOGGED_FIELDS:
            return
        _logged_fields.add(name)
        logger.warning("/v1/audio/speech ignores the field %r, which this server does not know (logged once)", name)


class OpenAIRoutes(Synthesis):
    async def openai_request(self, body: SpeechOptions, text: str, caller: Caller) -> SynthesisRequest:
        """The synthesis request of OpenAI's speech options: the model name checked (an alias, also with a snapshot
        suffix), the voice resolved (OpenAI names included), empty instructions as none."""
        if served_model(body.model, self.model_name, self.model_names[1:]) is None:
            accepted = ", ".join(repr(name) for name in self.model_names)
            raise UnknownModelError(
                f"unknown model {body.model!r}; this server accepts {accepted} (an alias also with a snapshot suffix "
                "such as -2025-12-15)"
            )
        instructions = body.instructions if body.instructions and body.instructions.strip() else None  # "": none
        return SynthesisRequest(
            text=text,
            voice=await self.resolve_voice(body.voice_id, caller),
            instruct_text=instructions,
            speed=body.speed,
            language=body.language,
        )

    @api.post("/v1/audio/speech")
    async def openai_speech(self, body: SpeechRequest, http: Request) -> Response:
        """OpenAI's speech endpoint: `stream_format` "audio" streams the file as it is decoded (every format but
        flac), "sse" sends it as base64 `speech.audio.delta` events."""
        log_ignored_fields(body)
        request = await self.openai_request(body, body.input, caller_of(http.scope))
        mode = openai_mode(body.stream_format, body.response_format, await self.model_info(), body.speed)
        return await self.respond(request, body.response_format, mode, http, output_rate=OPENAI_SAMPLE_RATE)
