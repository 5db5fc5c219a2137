"""What clients written for OpenAI need of the ingress, without Ray: instructions a voice cannot follow are spoken
without them and the answer says why (a 400 with `openai.strict_instructions`), and the model and voice lists Open
WebUI reads. The ingress's own methods run on a replica's state; the Encoder deployment's voice calls are its own
methods over a real registry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.responses import Response

from deployments.encoder import Encoder, ModelInfo
from engine.errors import InvalidInputError
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.default_voice import DEFAULT_VOICE_ID
from engine.voices.registry import EVERYONE, Caller, VoiceRegistry
from serve_app import openai_routes
from serve_app.openai_routes import OpenAIRoutes, ignored_instructions_headers
from serve_app.request_args import OPENAI_TTS_MODELS, OPENAI_VOICE_NAMES, LimitsArgs, OpenAIArgs
from serve_app.schemas import SpeechRequest
from serve_app.synthesis import Synthesis, instructions_refusal
from serve_app.text_stream import done_event
from tests.serve.conftest import model_info
from tests.serve.test_voice_registry import ALICE, BOB, make_prompt

V1_INFO = model_info(voices=("dummy_female", "dummy_male"))
V1_INSTRUCT_INFO = replace(V1_INFO, model="CosyVoice-300M-Instruct", instructions="any_voice")
V3_INFO = replace(V1_INFO, model="cosyvoice3-tiny", family="CosyVoice3", instructions="registered_voices")
INSTRUCTIONS = "You will receive partial sentences. Do not complete the sentence, just read out the text."


@pytest.fixture
def serve_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """`caplog` with Serve's logger (it does not propagate), and the once-per-voice memory of ignored instructions
    fresh."""
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addHandler(caplog.handler)
    with caplog.at_level(logging.INFO, logger="ray.serve"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(openai_routes, "_logged_ignored", openai_routes.LoggedOnce(openai_routes.MAX_LOGGED_IGNORED))
        yield caplog
    serve_logger.removeHandler(caplog.handler)


class EncoderVoiceCalls:
    """The Encoder deployment's voice calls as the ingress awaits them (`encoder.list_voices.remote(caller)`), run by
    the deployment's own methods over `registry`."""

    def __init__(self, registry: VoiceRegistry) -> None:
        replica = SimpleNamespace(registry=registry)

        def remote_call(method: Any) -> SimpleNamespace:
            async def remote(*args: Any) -> Any:
                return method(replica, *args)

            return SimpleNamespace(remote=remote)

        self.list_voices = remote_call(Encoder.func_or_class.list_voices)
        self.named_voice = remote_call(Encoder.func_or_class.named_voice)


def routes_of(info: ModelInfo, registry: VoiceRegistry, **openai: Any) -> OpenAIRoutes:
    """The OpenAI route group on an ingress replica's `Synthesis` (voices from `registry`, no decoders), serving a
    model that `info` describes."""
    synthesis = Synthesis(EncoderVoiceCalls(registry), None, info.model, LimitsArgs(), OpenAIArgs(**openai))
    synthesis._info = info  # as if asked of an encoder replica
    return OpenAIRoutes(synthesis)


def served(routes: OpenAIRoutes) -> ModelInfo:
    """The model the routes serve, as a request reads it."""
    return asyncio.run(routes.synthesis.model_info())


def ask(routes: OpenAIRoutes, body: SpeechRequest) -> tuple[SynthesisRequest, str | None]:
    """`openai_request` of `body` (its text "Hi.", keys off), as `/v1/audio/speech` makes it."""
    return asyncio.run(routes.openai_request(body, "Hi.", EVERYONE, served(routes)))


def speech(voice: str, instructions: str | None = INSTRUCTIONS) -> SpeechRequest:
    return SpeechRequest(model="gpt-4o-mini-tts", input="Hi.", voice=voice, instructions=instructions)


def test_which_voices_follow_instructions() -> None:
    none = instructions_refusal(V1_INFO, "dummy_female")
    assert none is not None and "cannot follow instructions" in none
    assert instructions_refusal(V1_INSTRUCT_INFO, "dummy_female") is None
    built_in = instructions_refusal(V3_INFO, "dummy_female")
    assert built_in is not None and "registered (cloned) voice only" in built_in
    # instruct2 needs a stored prompt: a registered or provisioned voice has one, and so has the default voice
    assert instructions_refusal(V3_INFO, "voice_0123456789ab") is None
    assert instructions_refusal(V3_INFO, DEFAULT_VOICE_ID) is None


def test_instructions_a_voice_cannot_follow_are_dropped_said_and_logged_once_per_voice(
    tmp_path: Path, serve_log: pytest.LogCaptureFixture
) -> None:
    routes = routes_of(V1_INFO, VoiceRegistry(tmp_path))
    for _ in range(2):
        request, ignored = ask(routes, speech("ash"))
        assert request.voice == "dummy_male" and request.instruct_text is None  # spoken, without them
        assert ignored is not None and "cannot follow instructions" in ignored
    ask(routes, speech("dummy_female"))
    logged = [record.getMessage() for record in serve_log.records]
    assert len(logged) == 2 and "'dummy_male'" in logged[0] and "'dummy_female'" in logged[1], logged
    assert all("openai.strict_instructions" in message and "'tiny'" in message for message in logged)
    # none given (an empty one is none): nothing to ignore
    for instructions in (None, "  "):
        request, ignored = ask(routes, speech("ash", instructions))
        assert request.instruct_text is None and ignored is None


def test_a_voice_that_follows_instructions_keeps_them(tmp_path: Path) -> None:
    registry = VoiceRegistry(tmp_path)
    voice = registry.add(make_prompt(), "mine", duration_s=1.0, caller=EVERYONE).id
    routes = routes_of(V3_INFO, registry)
    request, ignored = ask(routes, speech(voice))
    assert request.instruct_text == INSTRUCTIONS and ignored is None
    request, ignored = ask(routes, speech("alloy"))  # a built-in speaker
    assert request.instruct_text is None and ignored is not None and "registered (cloned) voice only" in ignored


def test_strict_instructions_keep_the_400(tmp_path: Path, serve_log: pytest.LogCaptureFixture) -> None:
    routes = routes_of(V1_INFO, VoiceRegistry(tmp_path), strict_instructions=True)
    request, ignored = ask(routes, speech("ash"))
    assert request.instruct_text == INSTRUCTIONS and ignored is None
    with pytest.raises(InvalidInputError, match="cannot follow instructions") as refused:
        routes.synthesis.checked(request, served(routes))
    assert refused.value.http_status == 400 and not serve_log.records


def test_the_answer_says_the_instructions_were_ignored_and_why_in_ascii() -> None:
    reason = "CosyVoice2 follows instructions in a registered (cloned) voice only: not in '中文女'"
    response = Response(b"audio")
    response.headers.update(ignored_instructions_headers(reason))  # as the route adds them; Latin-1 encodable
    assert response.headers["x-instructions"] == "ignored"
    assert response.headers["x-instructions-reason"] == reason.replace("中文女", "\\u4e2d\\u6587\\u5973")
    usage = {"input_tokens": 2, "output_tokens": 40, "total_tokens": 42}
    assert done_event(usage, None) == {"type": "speech.audio.done", "usage": usage}  # the text stream's
    said = done_event(usage, reason)
    assert said["instructions"] == "ignored" and said["instructions_reason"] == reason


def test_open_webui_reads_the_models_and_the_voices_the_caller_may_use(tmp_path: Path) -> None:
    """Read as Open WebUI's OpenAI engine reads them (`backend/open_webui/routers/audio.py`: `data.get("models", [])`,
    and `{voice["id"]: voice["name"] for voice in data.get("voices", [])}`); every id is a `model` or `voice` that a
    request may send."""
    registry = VoiceRegistry(tmp_path)
    shared = registry.add(make_prompt(1), "House", 1.0, Caller(owner=None, admin=True), True, openai_name="narrator")
    own_record = registry.add(make_prompt(2), "Alice's", duration_s=1.0, caller=ALICE)
    own = own_record.id
    other = registry.add(make_prompt(3), "Bob's", duration_s=1.0, caller=BOB).id
    routes = routes_of(V1_INFO, registry)
    http = SimpleNamespace(scope={"state": {"caller": ALICE}})

    models = [model["id"] for model in asyncio.run(routes.audio_models()).get("models", [])]
    assert models == ["tiny", *OPENAI_TTS_MODELS]
    voices = {voice["id"]: voice["name"] for voice in asyncio.run(routes.audio_voices(http)).get("voices", [])}
    # The registered voices oldest first; those of the same second by id (the registry's order).
    registered = [record.id for record in sorted([shared, own_record], key=lambda r: (r.created_at, r.id))]
    assert list(voices) == [*V1_INFO.voices, *OPENAI_VOICE_NAMES, "narrator", *registered]
    assert other not in voices  # another key's voice
    assert voices["alloy"] == "alloy (OpenAI's name for dummy_female)" and voices[own] == "Alice's"
    assert voices["narrator"] == f"narrator (OpenAI's name for {shared.id})" and voices[shared.id] == "House"
    for voice in voices:
        asyncio.run(
            routes.synthesis.resolve_voice(voice, ALICE, served(routes))
        )  # known to the request path: no UnknownVoiceError
