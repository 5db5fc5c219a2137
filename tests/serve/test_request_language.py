"""A request's `language` (the language its numbers are read in) on the HTTP APIs, and the app arg that turns the
spelling off; no Ray cluster."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve._private.build_app import build_app as build_deployments

from deployments.encoder import ModelInfo
from engine.errors import InvalidInputError
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.registry import Caller
from serve_app.args import AppArgs
from serve_app.errors import error_payload
from serve_app.ingress import build_app
from serve_app.openai_routes import OpenAIRoutes
from serve_app.schemas import SpeechRequest, StreamStart, TTSRequest
from tests.serve.conftest import model_info


def test_the_openai_body_takes_a_language_and_the_request_carries_it() -> None:
    body = SpeechRequest.model_validate(
        {"model": "tts-1", "voice": "alloy", "input": "Das kostet 3 €.", "language": "de-DE"}
    )
    assert body.model_extra == {}  # a field of its own, not an ignored one

    async def resolve_voice(voice: str, caller: Caller, info: ModelInfo) -> str:
        return "dummy_female"

    routes = OpenAIRoutes(
        SimpleNamespace(model_name="tiny", model_names=("tiny", "tts-1"), resolve_voice=resolve_voice)
    )
    request, ignored = asyncio.run(routes.openai_request(body, body.input, Caller(None, admin=False), model_info()))
    assert ignored is None  # no instructions sent
    assert request.language == "de-DE" and request.validated().language == "de"
    assert StreamStart.model_validate({"type": "start", "model": "tiny", "voice": "alloy", "language": "ja"}).language
    assert TTSRequest.model_validate({"text": "Hola.", "language": "es"}).language == "es"


def test_a_language_the_engine_does_not_know_is_a_400_naming_the_known_ones() -> None:
    with pytest.raises(InvalidInputError) as raised:
        SynthesisRequest(text="Olá.", voice="dummy_female", language="pt-BR").validated()
    status, body = error_payload(raised.value, "req-1")
    assert status == 400
    assert body["error"]["message"].startswith("language must be one of zh, en, yue, de, es, fr, it, ru, ja, ko")


@pytest.mark.parametrize("spell_out", [True, False])
def test_the_text_app_arg_reaches_the_encoders_front_end(spell_out: bool) -> None:
    args = {"model": "tiny", "decoder_cpu": {"enabled": False}, "text": {"spell_out_languages": spell_out}}
    [encoder] = [d for d in build_deployments(build_app(args), name="app").deployments if d.name == "Encoder"]
    assert encoder.init_kwargs["spell_out_languages"] is spell_out
    assert AppArgs().text.spell_out_languages  # on by default
