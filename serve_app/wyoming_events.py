"""The Wyoming protocol's events as the listener (`serve_app.wyoming_listener`) reads and answers them: each read with
bounds (one event at most `limits.max_body_bytes`), since `wyoming`'s own reader buffers whatever length a header
claims; the text and voice a synthesis event asks for; and the `info` event that answers `describe`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from wyoming.event import Event
from wyoming.info import Attribution, Info, TtsProgram, TtsVoice

from engine.errors import InvalidInputError
from engine.text.frontend import lone_surrogate_at
from serve_app.wyoming_speech import WyomingCatalog

PROGRAM_NAME = "cosyvoice-serve"
ATTRIBUTION = Attribution(name="FunAudioLLM CosyVoice", url="https://github.com/FunAudioLLM/CosyVoice")


def json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise InvalidInputError(f"an event's {what} is not JSON") from None
    if not isinstance(value, dict):
        raise InvalidInputError(f"an event's {what} is not a JSON object")
    return value


def declared_length(header: dict[str, Any], key: str, max_bytes: int) -> int:
    length = header.get(key) or 0
    if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= max_bytes:
        raise InvalidInputError(f"an event's {key} must be a whole number of bytes from 0 to {max_bytes}")
    return length


async def read_event(reader: asyncio.StreamReader, max_bytes: int) -> Event | None:
    """The next event (a JSON header line, then its declared data and payload bytes); None once the client has
    closed the connection, also mid-event. InvalidInputError for an event that cannot be read: the connection
    cannot go on after one. The reader's own limit bounds the header line."""
    try:
        line = await reader.readline()
    except ValueError:  # asyncio's LimitOverrunError: no newline within the reader's limit
        raise InvalidInputError(f"an event's header line is longer than {max_bytes} bytes") from None
    if not line.endswith(b"\n"):  # nothing more, or a line cut by the close
        return None
    header = json_object(line, "header")
    event_type = header.get("type")
    if not isinstance(event_type, str):
        raise InvalidInputError('an event header needs "type", a string')
    data = header.get("data") or {}
    if not isinstance(data, dict):
        raise InvalidInputError('an event\'s "data" is not a JSON object')
    data_length = declared_length(header, "data_length", max_bytes)
    payload_length = declared_length(header, "payload_length", max_bytes)
    try:
        if data_length:
            data = data | json_object(await reader.readexactly(data_length), "data")
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError:
        return None
    return Event(type=event_type, data=data, payload=payload)


def event_text(event: Event) -> str:
    text = event.data.get("text")
    if not isinstance(text, str):
        raise InvalidInputError(f'a {event.type} event needs "text", a string')
    index = lone_surrogate_at(text)
    if index is not None:
        raise InvalidInputError(f"the text holds a lone surrogate (U+{ord(text[index]):04X}) at character {index}")
    return text


def event_voice(event: Event) -> str | None:
    """The voice name an event asks for; None (the model's default voice) for none, or a language alone."""
    voice = event.data.get("voice")
    if voice is None:
        return None
    if not isinstance(voice, dict):
        raise InvalidInputError('"voice" must be an object such as {"name": "alloy"}')
    name = voice.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidInputError('"voice"."name" must be a string')
    return name


def check_plain_text(event: Event) -> None:
    text_format = event.data.get("text_format")
    if text_format not in (None, "text"):
        raise InvalidInputError(f"text_format {text_format!r} is not supported: send plain text")


def info_event(catalog: WyomingCatalog) -> Event:
    """Wyoming's `info`: one TTS program, the served model, whose voices each speak every language of the model's
    family (Home Assistant lists a voice under each of its languages, and none without one)."""
    languages = list(catalog.languages)
    voices = [
        TtsVoice(
            name=voice.name,
            attribution=ATTRIBUTION,
            installed=True,
            description=voice.description,
            version=None,
            languages=languages,
        )
        for voice in catalog.voices
    ]
    program = TtsProgram(
        name=PROGRAM_NAME,
        attribution=ATTRIBUTION,
        installed=True,
        description=f"CosyVoice text to speech: {catalog.model} ({catalog.family}, {catalog.sample_rate} Hz)",
        version=None,
        voices=voices,
        supports_synthesize_streaming=True,
    )
    return Info(tts=[program]).event()
