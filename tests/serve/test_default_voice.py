"""The default voice of a model without built-in speakers: the shipped official prompt recording (byte for byte, and
what an upload may be), and the OpenAI voice names it answers, after the deployment's own and the registered ones."""

from __future__ import annotations

import hashlib

import pytest

from engine.errors import UnknownVoiceError
from engine.voices.cloning import decode_prompt_audio
from engine.voices.default_voice import DEFAULT_VOICE_FILE, DEFAULT_VOICE_ID
from engine.voices.registry import is_voice_id
from serve_app.args import AppArgs
from serve_app.ingress import voice_cloning_config
from serve_app.request_args import DEFAULT_OPENAI_VOICES
from serve_app.voice_names import mapped_voice, openai_voice_table

# asset/zero_shot_prompt.wav of FunAudioLLM/CosyVoice at ace7c47 (engine/voices/assets/README.md)
OFFICIAL_SHA256 = "c7b31d6dbe7cc6a716dded00550db5b50940bf209e424e4ad207b12e657c8ff6"
NARRATOR = "voice_0123456789ab"


def test_the_shipped_recording_is_the_official_one_and_a_valid_prompt() -> None:
    audio = DEFAULT_VOICE_FILE.read_bytes()
    assert hashlib.sha256(audio).hexdigest() == OFFICIAL_SHA256
    waveform, rate = decode_prompt_audio(audio)
    assert rate == 24000 and 3.4 < len(waveform) / rate < 3.6
    assert is_voice_id(DEFAULT_VOICE_ID)


def test_the_default_voice_answers_the_names_nothing_else_takes() -> None:
    table = DEFAULT_OPENAI_VOICES | {"alloy": NARRATOR}  # alloy provisioned by the operator
    answered = openai_voice_table(table, [], DEFAULT_VOICE_ID)
    assert answered["alloy"] == NARRATOR and answered["echo"] == answered["nova"] == DEFAULT_VOICE_ID
    assert set(answered) == set(table)
    assert mapped_voice("echo", table, [], DEFAULT_VOICE_ID) == DEFAULT_VOICE_ID
    # with built-in speakers the table stands as it is; without a default voice only registered ids answer
    assert openai_voice_table(table, ["dummy_male"], DEFAULT_VOICE_ID) == table
    assert openai_voice_table(table, []) == {"alloy": NARRATOR}
    with pytest.raises(UnknownVoiceError, match="app args default_voice"):
        mapped_voice("echo", table, [])


def test_the_encoders_are_told_to_provision_it_unless_turned_off() -> None:
    on = voice_cloning_config(AppArgs(model="cosyvoice3-tiny", voices_dir="/tmp/voices"))
    off = voice_cloning_config(AppArgs(model="cosyvoice3-tiny", voices_dir="/tmp/voices", default_voice=False))
    assert on is not None and on.default_voice and off is not None and not off.default_voice
