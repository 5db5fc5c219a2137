"""The voice names a request may send, as the served model and the app args' `openai.voices` table read them: a
built-in speaker, a registered voice's id, or an OpenAI voice name standing for one of them."""

from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import UnknownVoiceError
from engine.voices.registry import is_voice_id


def openai_voice_table(
    table: dict[str, str], built_in: Sequence[str], default_voice: str | None = None
) -> dict[str, str]:
    """The OpenAI voice names the served model answers (`/v1/voices` shows them): the app args' table (with the
    voices provisioned at deploy) for a model with built-in speakers; for one without (CosyVoice3), the names that
    stand for a registered voice id, such as a provisioned voice's `openai_name`, and every other name of the table
    for the `default_voice` where one was provisioned (app args `default_voice`)."""
    if built_in:
        return dict(table)
    registered = {name: target for name, target in table.items() if is_voice_id(target)}
    return registered if default_voice is None else dict.fromkeys(table, default_voice) | registered


def mapped_voice(voice: str, table: dict[str, str], built_in: Sequence[str], default_voice: str | None = None) -> str:
    """A built-in speaker or registered voice as is; an OpenAI voice name (a key of `table`, the app args'
    `openai.voices`) as the voice it stands for (`openai_voice_table`), which must be a built-in speaker or a
    registered voice id."""
    if voice in built_in or voice not in table:
        return voice
    answered = openai_voice_table(table, built_in, default_voice)
    if voice not in answered:
        raise UnknownVoiceError(
            f"voice {voice!r} is an OpenAI voice name, and this model has no built-in speakers: it stands for a voice "
            "only where the server provisions one for it (app args voices, with openai_name; the default voice, app "
            "args default_voice, with voices_dir) or openai.voices maps it to a registered voice id; use a registered "
            "voice's id (GET /v1/voices)"
        )
    target = answered[voice]
    if target not in built_in and not is_voice_id(target):
        raise UnknownVoiceError(
            f"voice {voice!r} stands for {target!r} (openai.voices), which this model does not have; its voices: "
            f"{', '.join(built_in) or 'none'}"
        )
    return target


@dataclass(frozen=True)
class CatalogVoice:
    """A voice a caller may send, as the lists of clients show it (Open WebUI's `/v1/audio/voices`, Wyoming's
    `describe`)."""

    name: str  # what a client sends as `voice`
    description: str  # what a client's menu shows
