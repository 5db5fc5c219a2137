"""OpenAI's speech endpoint, `/v1/audio/speech`, and the lists Open WebUI reads beside it, `/v1/audio/models` and
`/v1/audio/voices`."""

import logging
import re
from collections.abc import Hashable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from deployments.encoder import ModelInfo
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.registry import Caller
from serve_app.audio import OPENAI_SAMPLE_RATE
from serve_app.errors import UnknownModelError
from serve_app.schemas import SpeechOptions, SpeechRequest
from serve_app.synthesis import Synthesis, delivery, instructions_refusal
from serve_app.tenancy import caller_of

logger = logging.getLogger("ray.serve")

# OpenAI names dated snapshots after their model: gpt-4o-mini-tts-2025-12-15, tts-1-1106, tts-1-hd-1106.
SNAPSHOT_SUFFIX = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{4})$")
MAX_LOGGED_FIELDS = 64  # unknown field names logged, at most: a client cannot grow the set or flood the log
MAX_LOGGED_IGNORED = 256  # (model, voice) pairs whose ignored instructions are logged, at most: as for the fields


class LoggedOnce:
    """The keys already logged, at most `limit` of them: a client can neither grow the set nor flood the log."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.keys: set[Hashable] = set()

    def first(self, key: Hashable) -> bool:
        """Whether `key` is to be logged now: not logged before, and the limit not reached (it is then kept)."""
        if key in self.keys or len(self.keys) >= self.limit:
            return False
        self.keys.add(key)
        return True


def served_model(name: str, served: str, aliases: tuple[str, ...]) -> str | None:
    """What a request's `model` stands for: the served model or one of its aliases, also an alias followed by a
    snapshot suffix; None for any other name."""
    if name == served or name in aliases:
        return name
    alias = SNAPSHOT_SUFFIX.sub("", name)
    return alias if alias != name and alias in aliases else None


_logged_fields = LoggedOnce(MAX_LOGGED_FIELDS)


def log_ignored_fields(body: SpeechRequest) -> None:
    """Log each unknown field name once (of the first MAX_LOGGED_FIELDS)."""
    for name in sorted(body.model_extra or ()):
        if _logged_fields.first(name):
            logger.warning("/v1/audio/speech ignores the field %r, which this server does not know (logged once)", name)


_logged_ignored = LoggedOnce(MAX_LOGGED_IGNORED)


def log_ignored_instructions(model: str, voice: str, reason: str) -> None:
    """Log that instructions go unfollowed, once per model and voice (of the first MAX_LOGGED_IGNORED)."""
    if not _logged_ignored.first((model, voice)):
        return
    logger.warning(
        "instructions in the voice %r are ignored: %s (logged once per model and voice; app args "
        "openai.strict_instructions: true answers 400 instead)",
        voice,
        reason,
    )


def ignored_instructions_headers(reason: str) -> dict[str, str]:
    """The headers that say a response ignored its request's instructions, and why. The reason goes in ASCII, any other
    character as a backslash escape: header values are Latin-1 at best, and a speaker's name may be Chinese."""
    return {"X-Instructions": "ignored", "X-Instructions-Reason": reason.encode("ascii", "backslashreplace").decode()}


class OpenAIRoutes:
    """OpenAI's speech endpoint and Open WebUI's lists, on the replica's `Synthesis`."""

    def __init__(self, synthesis: Synthesis) -> None:
        self.synthesis = synthesis

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/audio/speech", self.openai_speech, methods=["POST"])
        router.add_api_route("/v1/audio/models", self.audio_models, methods=["GET"])
        router.add_api_route("/v1/audio/voices", self.audio_voices, methods=["GET"])
        return router

    async def openai_request(
        self, body: SpeechOptions, text: str, caller: Caller, info: ModelInfo
    ) -> tuple[SynthesisRequest, str | None]:
        """The synthesis request of OpenAI's speech options: the model name checked (an alias, also with a snapshot
        suffix), the voice resolved (OpenAI names included), empty instructions as none; and, where the voice cannot
        follow the instructions, why: they are dropped, as OpenAI's tts-1 ignores them (unless
        `openai.strict_instructions`, where the request goes on with them, to be refused with that reason)."""
        synthesis = self.synthesis
        if served_model(body.model, synthesis.model_name, synthesis.model_names[1:]) is None:
            accepted = ", ".join(repr(name) for name in synthesis.model_names)
            raise UnknownModelError(
                f"unknown model {body.model!r}; this server accepts {accepted} (an alias also with a snapshot suffix "
                "such as -2025-12-15)"
            )
        voice = await synthesis.resolve_voice(body.voice_id, caller, info)
        instructions = body.instructions if body.instructions and body.instructions.strip() else None  # "": none
        ignored = None
        if instructions is not None and not synthesis.openai.strict_instructions:
            ignored = instructions_refusal(info, voice)
            if ignored is not None:
                log_ignored_instructions(info.model, voice, ignored)
                instructions = None
        request = SynthesisRequest(
            text=text, voice=voice, instruct_text=instructions, speed=body.speed, language=body.language
        )
        return request, ignored

    async def openai_speech(self, body: SpeechRequest, http: Request) -> Response:
        """OpenAI's speech endpoint: `stream_format` "audio" streams the file as it is decoded (every format but
        flac), "sse" sends it as base64 `speech.audio.delta` events."""
        log_ignored_fields(body)
        info = await self.synthesis.model_info()
        request, ignored = await self.openai_request(body, body.input, caller_of(http.scope), info)
        answer = delivery(body.stream_format, body.response_format, info, body.speed)
        response = await self.synthesis.respond(request, answer, info, http, output_rate=OPENAI_SAMPLE_RATE)
        if ignored is not None:
            response.headers.update(ignored_instructions_headers(ignored))
        return response

    async def audio_models(self) -> dict[str, list[dict[str, str]]]:
        """Open WebUI's model list (its OpenAI engine reads `{base}/audio/models`): the names `model` takes, as
        `/v1/models` lists them."""
        return {"models": [{"id": name} for name in self.synthesis.model_names]}

    async def audio_voices(self, http: Request) -> dict[str, list[dict[str, str]]]:
        """Open WebUI's voice list (`{base}/audio/voices`): the voices the caller may use (`voice_catalog`), each
        with the `voice` to send (`id`) and what its menu shows (`name`)."""
        info = await self.synthesis.model_info()
        voices = await self.synthesis.voice_catalog(caller_of(http.scope), info)
        return {"voices": [{"id": voice.name, "name": voice.description} for voice in voices]}
