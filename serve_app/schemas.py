"""Request bodies of the HTTP API (OpenAI-compatible `/v1/audio/speech` and native `/v1/tts`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from serve_app.audio import FORMATS

OPENAI_DEFAULT_FORMAT = "mp3" if "mp3" in FORMATS else "wav"


class _Body(BaseModel):
    # Unknown fields are an error, so a misspelt option never silently does nothing.
    model_config = ConfigDict(extra="forbid")


class VoiceRef(_Body):
    id: str


class SpeechRequest(_Body):
    """OpenAI's `audio.speech.create` body."""

    model: str
    input: str
    voice: str | VoiceRef
    instructions: str | None = None
    response_format: str = OPENAI_DEFAULT_FORMAT
    speed: float = 1.0
    stream_format: Literal["audio", "sse"] = "audio"

    @property
    def voice_id(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


class SamplingBody(_Body):
    """Speech-token sampling; unset fields keep the engine defaults (the engine validates the values)."""

    greedy: bool | None = None
    top_p: float | None = None
    top_k: int | None = None
    win_size: int | None = None
    tau_r: float | None = None
    min_token_text_ratio: float | None = None
    max_token_text_ratio: float | None = None


class TTSRequest(_Body):
    """The native body: every engine option, and `stream` for a chunked response."""

    text: str
    voice: str | None = Field(
        None, description="built-in speaker or registered voice id; default: the model's first built-in voice"
    )
    format: str = "wav"
    stream: bool = False
    instruct_text: str | None = None
    cross_lingual: bool = Field(
        False, description="with a registered voice: keep its timbre but not its transcript (text in another language)"
    )
    seed: int | None = Field(None, ge=0, description="makes the request reproducible")
    speed: float = 1.0
    sampling: SamplingBody = SamplingBody()
