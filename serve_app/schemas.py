"""Request bodies of the HTTP API (OpenAI-compatible `/v1/audio/speech` and native `/v1/tts`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from engine.llm.sampling import MAX_SEED, MAX_TOKEN_TEXT_RATIO, MAX_TOP_K, MAX_WIN_SIZE
from engine.runtime.synthesis_request import MAX_SPEED, MIN_SPEED
from engine.text.frontend import lone_surrogate_at
from serve_app.audio import FORMATS

OPENAI_DEFAULT_FORMAT = "mp3" if "mp3" in FORMATS else "wav"


def unicode_text(text: str) -> str:
    """`text`; ValueError for one holding a lone surrogate (JSON's "\\ud800" escape alone), which is no character."""
    index = lone_surrogate_at(text)
    if index is not None:
        raise ValueError(
            f"holds a lone surrogate (U+{ord(text[index]):04X}) at character {index}: half of a UTF-16 pair is not "
            "text; send the whole pair or the character itself"
        )
    return text


# Every string of a request: a 400 naming the field instead of a tokenizer's TypeError (a 500) further on.
Text = Annotated[str, AfterValidator(unicode_text)]


class _Body(BaseModel):
    # Unknown fields are an error, so a misspelt option never silently does nothing; JSON's NaN and Infinity (which
    # Python's parser takes) are refused by name, as every number out of its bounds is.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


Speed = Annotated[float, Field(ge=MIN_SPEED, le=MAX_SPEED, description="speaking rate (1.0: as recorded)")]
Language = Annotated[
    Text | None,
    Field(
        description="the text's language (zh, en, yue, de, es, fr, it, ru, ja, ko; de-DE also): numbers, dates, units "
        "and currencies are read in it where the model speaks it; default: each sentence's, detected"
    ),
]


class VoiceRef(_Body):
    id: Text


class SpeechOptions(_Body):
    """The options of OpenAI's speech endpoint, the text aside: its body's and a text stream's `start` message's."""

    model: Text
    voice: Text | VoiceRef
    instructions: Text | None = None
    response_format: Text = OPENAI_DEFAULT_FORMAT
    speed: Speed = 1.0
    language: Language = None

    @property
    def voice_id(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


class SpeechRequest(SpeechOptions):
    """OpenAI's `audio.speech.create` body. Fields this server does not know are taken and ignored (the route logs
    each name once), so a newer OpenAI client that sends one more field keeps working; the native body stays
    strict, where a misspelt option must not silently do nothing."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    input: Text
    stream_format: Literal["audio", "sse"] = "audio"


# The messages of a text stream (`/v1/audio/speech/stream`, a WebSocket), told apart by `type`; strict, as the
# protocol is this server's own.
class StreamStart(SpeechOptions):
    type: Literal["start"]


class StreamText(_Body):
    type: Literal["text"]
    text: Text


class StreamFlush(_Body):
    type: Literal["flush"]


class StreamEnd(_Body):
    type: Literal["end"]


StreamMessage = Annotated[StreamStart | StreamText | StreamFlush | StreamEnd, Field(discriminator="type")]


class SamplingBody(_Body):
    """Speech-token sampling; unset fields keep the engine defaults. The bounds are the engine's (which checks them
    again, with the fields' relations such as min <= max ratio)."""

    greedy: bool | None = None
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1, le=MAX_TOP_K)
    win_size: int | None = Field(None, ge=1, le=MAX_WIN_SIZE)
    tau_r: float | None = Field(None, ge=0, le=1)
    min_token_text_ratio: float | None = Field(None, ge=0, le=MAX_TOKEN_TEXT_RATIO)
    max_token_text_ratio: float | None = Field(
        None, gt=0, le=MAX_TOKEN_TEXT_RATIO, description="speech tokens per text token at most: bounds the length"
    )


class TTSRequest(_Body):
    """The native body: every engine option, and `stream` for a chunked response."""

    text: Text
    voice: Text | None = Field(
        None, description="built-in speaker or registered voice id; default: the model's first built-in voice"
    )
    format: Text = "wav"
    stream: bool = False
    instruct_text: Text | None = None
    cross_lingual: bool = Field(
        False, description="with a registered voice: keep its timbre but not its transcript (text in another language)"
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="makes the request reproducible")
    speed: Speed = 1.0
    language: Language = None
    sampling: SamplingBody = SamplingBody()
