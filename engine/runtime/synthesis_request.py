"""What a caller asks for (`SynthesisRequest`) and what the text encoder makes of it before encoding: the text ids of
each sentence (`SegmentText`), the voice's conditioning (`VoiceConditioning`) and the two together (`EncodingPlan`).
Plain data: they can cross a process boundary."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field, replace

import numpy as np

from engine.errors import InvalidInputError
from engine.llm.sampling import SamplingOptions
from engine.text.frontend import ENDOFPROMPT
from engine.text.languages import language_code

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range; the mel is stretched by 1 / speed


@dataclass(frozen=True)
class SynthesisRequest:
    """What a caller asks for. `seed` makes the request reproducible; None draws one.

    `cross_lingual` (with a cloned voice) keeps the prompt's voice but not its transcript and speech
    tokens in the LLM input, for text in another language than the prompt. `instruct_text` is a plain
    instruction ("Speak happily.") or one in the official form, ending in `<|endofprompt|>` (taken as written).
    `system_prompt` replaces the family's default system prompt (CosyVoice3: "You are a helpful assistant.");
    families without one refuse it. `language` is the text's (`engine.text.languages.LANGUAGES`, a region allowed:
    "de-DE"): its numbers are spelled out in it where the front end does that language; None: each sentence's.
    """

    text: str
    voice: str
    instruct_text: str | None = None
    speed: float = 1.0
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    cross_lingual: bool = False
    system_prompt: str | None = None
    language: str | None = None

    def validated(self) -> SynthesisRequest:
        if not MIN_SPEED <= self.speed <= MAX_SPEED:
            raise InvalidInputError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {self.speed}")
        if self.instruct_text is not None and not self.instruct_text.strip():
            raise InvalidInputError("instruct_text must not be empty when given")
        if self.system_prompt is not None and (not self.system_prompt.strip() or ENDOFPROMPT in self.system_prompt):
            raise InvalidInputError(f"system_prompt must be non-empty text without {ENDOFPROMPT} (it is appended)")
        if self.cross_lingual and self.instruct_text is not None:
            raise InvalidInputError("cross_lingual and instruct_text cannot be combined")
        request = self if self.language is None else replace(self, language=language_code(self.language))
        if request.sampling.seed is None:
            return replace(request, sampling=replace(request.sampling, seed=secrets.randbits(31)))
        return request


@dataclass(frozen=True)
class SegmentText:
    """The text ids the LLM gets for one segment: `prompt` (system prompt, instruction or transcript), then `text`,
    whose length sets the segment's speech length bounds."""

    prompt: list[int]
    text: list[int]


@dataclass(frozen=True)
class VoiceConditioning:
    """How a voice enters the LLM and the flow, for one request mode."""

    prompt_text_tokens: list[int]
    text_lead_tokens: list[int]  # lead the text to speak and count with it (CosyVoice3 cross-lingual: system text)
    llm_embedding: np.ndarray | None
    flow_embedding: np.ndarray
    llm_prompt_speech_tokens: np.ndarray
    flow_prompt_speech_tokens: np.ndarray
    prompt_feat: np.ndarray

    @property
    def prompt_key(self) -> str:
        """A hash of every part of the voice that leads the LLM input or conditions the flow: two requests with the
        same key (and voice name) may share a decoder's prepared prompt (`engine.runtime.prompt_cache`)."""
        digest = hashlib.blake2b(digest_size=16)
        parts = (
            np.asarray(self.prompt_text_tokens, dtype=np.int64),
            np.zeros(0, np.float32) if self.llm_embedding is None else self.llm_embedding,
            np.asarray([self.llm_embedding is None]),
            self.flow_embedding,
            self.llm_prompt_speech_tokens,
            self.flow_prompt_speech_tokens,
            self.prompt_feat,
        )
        for part in parts:  # each part's dtype and shape too, so that no two tuples of parts hash alike by layout
            array = np.ascontiguousarray(part)
            digest.update(f"{array.dtype.str}{array.shape}".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()


@dataclass(frozen=True)
class EncodingPlan:
    """A request split into sentences, none encoded yet (`TextEncoderStage.plan`): `TextEncoderStage.encode_planned`
    encodes any run of them, so the first can go to the decoder before the others are encoded. Plain data: it can
    cross a process boundary."""

    request: SynthesisRequest  # validated: its seed is drawn
    voice: VoiceConditioning
    texts: tuple[SegmentText, ...]

    @property
    def num_segments(self) -> int:
        return len(self.texts)
