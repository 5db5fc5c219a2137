"""The two serving stages and the single-request API built from them.

`TextEncoderStage` (CPU: frontend, text encoding, voice features) turns a request into
`EncodedSegment`s, plain numpy records that can cross a process boundary; `SpeechDecoderStage`
(GPU or CPU: speech-token generation, flow, vocoder) turns a batch of them into waveforms.
`CosyVoice.synthesize` runs both in-process.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from engine.errors import InvalidInputError, NonFiniteOutputError, TextTooLongError
from engine.flow.masked_diff import FlowRequest
from engine.llm.generation import GenerationRequest, SilentRunFilter, prefill_prompt_prefix
from engine.llm.sampling import MAX_SEED, SamplingOptions
from engine.loading.loader import LoadedModel, load_model
from engine.runtime.bistream import BistreamStart, BistreamSynthesis, check_bistream
from engine.runtime.prompt_cache import PreparedPrompt, PromptCache, PromptKey
from engine.runtime.segment import EncodedSegment
from engine.runtime.streaming import DecodeStream
from engine.text.frontend import ENDOFPROMPT
from engine.text.languages import language_code

if TYPE_CHECKING:
    from engine.voices.cloning import VoicePrompt

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range; the mel is stretched by 1 / speed
# Sizes a decoder takes in one segment, checked before any of it is computed. The encoder's own inputs stay far below:
# a sentence of `limits.max_input_chars` text, a voice prompt of at most `limits.max_prompt_audio_s` (30 s: 1500
# speech tokens at 50 per second, 2600 mel frames).
MAX_SEGMENT_TEXT_TOKENS = 8192
MAX_PROMPT_SPEECH_TOKENS = 4096
MAX_PROMPT_MEL_FRAMES = 8192
MAX_VOICE_KEY_CHARS = 256  # a voice name or prompt key, as a segment carries it
# The text ids of one sentence, its prompt included, that the text encoder takes: its attention's memory grows with
# their square (v1, measured on the tiny model: 25 MB at 512, 77 MB at 1024, 301 MB at 2048, 4.7 GB at 8192). A
# split sentence has at most ~80 tokens; only a long run of text without sentence marks comes near this.
MAX_SENTENCE_TOKENS = 1024
# Sentences encoded in one call at most: rows x longest row^2 (padding makes every row the longest) within what one
# sentence of MAX_SENTENCE_TOKENS may take, so a long sentence beside many short ones costs no more than alone.
ENCODER_BATCH_TOKEN_PAIRS = MAX_SENTENCE_TOKENS**2


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
class _VoiceConditioning:
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
    voice: _VoiceConditioning
    texts: tuple[SegmentText, ...]

    @property
    def num_segments(self) -> int:
        return len(self.texts)


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Arrays arrive read-only from Ray's object store: copy into a writable tensor on `device`."""
    return torch.from_numpy(np.array(array)).to(device)


def encoder_batches(lengths: list[int], max_token_pairs: int) -> list[slice]:
    """Runs of consecutive rows, in order, each of which pads within `max_token_pairs` (rows x longest row^2), or
    is one row alone."""
    batches: list[slice] = []
    start = longest = 0
    for index, length in enumerate(lengths):
        if index > start and (index - start + 1) * max(longest, length) ** 2 > max_token_pairs:
            batches.append(slice(start, index))
            start, longest = index, 0
        longest = max(longest, length)
    return [*batches, slice(start, len(lengths))] if lengths else []


class TextEncoderStage:
    """Frontend + text encoder + voice features. Runs on CPU (optionally INT8)."""

    def __init__(self, model: LoadedModel, max_text_tokens: int | None = None) -> None:
        """`max_text_tokens`: the most tokens a request's text may have, as the tokenizer reads it before any
        normalisation (a cheap count that refuses token-heavy text, such as emoji, at once); None: no bound but each
        sentence's (MAX_SENTENCE_TOKENS)."""
        self.model = model
        self.max_text_tokens = max_text_tokens

    @property
    def voices(self) -> list[str]:
        return self.model.voices.names

    @property
    def sample_rate(self) -> int:
        return self.model.config.sample_rate

    def split_text(self, text: str) -> list[str]:
        """The sentences that will be synthesised one after another."""
        return self.model.frontend.split(text)

    def encode(self, request: SynthesisRequest, prompt: VoicePrompt | None = None) -> list[EncodedSegment]:
        """Validate, normalise, split and encode a request; one segment per sentence, in order.

        Without `prompt` the voice is a built-in speaker (`request.voice`); with a cloned-voice `prompt`
        the request is zero-shot (prompt transcript and speech tokens lead the LLM input), cross-lingual,
        or instruct (instruct2: the instruction replaces the transcript, the prompt speech stays in the flow).
        """
        return self.encode_planned(self.plan(request, prompt))

    @torch.inference_mode()
    def plan(self, request: SynthesisRequest, prompt: VoicePrompt | None = None) -> EncodingPlan:
        """Validate, normalise and split a request (as `encode`), encoding no sentence yet; TextTooLongError (413) for
        a text over `max_text_tokens` (before it is normalised) or a sentence over MAX_SENTENCE_TOKENS."""
        request = request.validated()
        self._check_token_count(request.text)
        voice = self._voice_conditioning(request, prompt)
        return EncodingPlan(request, voice, tuple(self._segment_texts(request, voice)))

    def replan(
        self, request: SynthesisRequest, texts: tuple[SegmentText, ...], prompt: VoicePrompt | None = None
    ) -> EncodingPlan:
        """The plan of a validated `request` whose sentences `plan` split already (`texts`), its voice made again from
        the speaker or `prompt`: the texts are small to send, the voice's arrays are not."""
        return EncodingPlan(request, self._voice_conditioning(request, prompt), texts)

    @torch.inference_mode()
    def encode_planned(self, plan: EncodingPlan, start: int = 0, stop: int | None = None) -> list[EncodedSegment]:
        """The segments of the plan's sentences `start` to `stop` (None: the last), each as `encode` makes it (its
        seed, index and count, text encoding included: a sentence encodes the same alone or with others)."""
        count = plan.num_segments
        stop = count if stop is None else stop
        if not 0 <= start < stop <= count:
            raise InvalidInputError(f"sentences {start} to {stop} are not a range of the request's {count}")
        texts, voice, request = plan.texts[start:stop], plan.voice, plan.request
        encoded = self._encode_batch([text.prompt + text.text for text in texts])
        prompt_key = voice.prompt_key
        return [
            EncodedSegment(
                text_encoded=text_encoded,
                text_len=len(text.text),
                llm_embedding=voice.llm_embedding,
                flow_embedding=voice.flow_embedding,
                llm_prompt_speech_tokens=voice.llm_prompt_speech_tokens,
                flow_prompt_speech_tokens=voice.flow_prompt_speech_tokens,
                prompt_feat=voice.prompt_feat,
                # each sentence its own draws; wrapped, so the largest seed stays a valid one
                sampling=replace(request.sampling, seed=(request.sampling.seed + index) % (MAX_SEED + 1)),
                speed=request.speed,
                segment_index=index,
                num_segments=count,
                voice=request.voice,
                prompt_key=prompt_key,
            )
            for index, text, text_encoded in zip(range(start, stop), texts, encoded, strict=True)
        ]

    @torch.inference_mode()
    def bistream_start(self, request: SynthesisRequest, prompt: VoicePrompt | None = None) -> BistreamStart:
        """A bi-streamed utterance of `request`'s voice and options (its text is ignored: it comes piece by piece,
        `text_piece_tokens`): the prompt text ids (the text lead of cross-lingual included) and the voice."""
        check_bistream(self.model.config.family)
        request = request.validated()
        voice = self._voice_conditioning(request, prompt)
        segment = EncodedSegment(
            text_encoded=np.zeros((0, 0), dtype=np.float32),  # never read: the text comes as ids, piece by piece
            text_len=0,
            llm_embedding=voice.llm_embedding,
            flow_embedding=voice.flow_embedding,
            llm_prompt_speech_tokens=voice.llm_prompt_speech_tokens,
            flow_prompt_speech_tokens=voice.flow_prompt_speech_tokens,
            prompt_feat=voice.prompt_feat,
            sampling=request.sampling,
            speed=request.speed,
            voice=request.voice,
        )
        prompt_text = np.asarray(list(voice.prompt_text_tokens) + list(voice.text_lead_tokens), dtype=np.int64)
        _check_sentence_tokens(len(prompt_text), "the prompt")
        return BistreamStart(prompt_text, segment)

    def text_piece_tokens(self, text: str) -> list[int]:
        """A bi-streamed text piece's ids: tokenized as it comes, not normalised (official generator input)."""
        return self.model.frontend.tokenize(text)

    def segment_texts(self, request: SynthesisRequest, prompt: VoicePrompt | None = None) -> list[SegmentText]:
        """The text ids each segment of `request` gives the LLM (what `encode` embeds), in the official form."""
        request = request.validated()
        return self._segment_texts(request, self._voice_conditioning(request, prompt))

    def _segment_texts(self, request: SynthesisRequest, voice: _VoiceConditioning) -> list[SegmentText]:
        segments = self.model.frontend.segment_tokens(request.text, request.language)
        texts = [SegmentText(voice.prompt_text_tokens, voice.text_lead_tokens + tokens) for tokens in segments]
        for text in texts:
            _check_sentence_tokens(len(text.prompt) + len(text.text), "a sentence with its prompt")
        return texts

    def _check_token_count(self, text: str) -> None:
        if self.max_text_tokens is None:
            return
        count = len(self.model.frontend.tokenize(text))
        if count > self.max_text_tokens:
            raise TextTooLongError(
                f"the input text is {count} tokens long; the limit is {self.max_text_tokens} (emoji and rare scripts "
                "take several tokens a character)"
            )

    def _voice_conditioning(self, request: SynthesisRequest, prompt: VoicePrompt | None) -> _VoiceConditioning:
        """The official frontend modes (sft, zero-shot, cross-lingual, instruct, instruct2) as one table of rules;
        the family's `VoiceRules` write the prompt texts (CosyVoice3: after its system prompt).

        A zero-shot speaker stored in spk2info.pt (official `zero_shot_spk_id`) acts as a cloned voice whose
        prompt is already tokenized."""
        family = self.model.config.family
        frontend, rules = self.model.frontend, family.voice_rules
        if request.system_prompt is not None:
            rules = rules.with_system_prompt(request.system_prompt, family.name)
        no_tokens = np.zeros(0, dtype=np.int64)
        stored = self.model.voices.stored_prompt(request.voice) if prompt is None else None
        if stored is not None:
            speaker, llm_embedding = stored.flow_embedding, stored.llm_embedding
            speech_tokens, llm_speech_tokens = stored.flow_speech_tokens, stored.llm_speech_tokens
            feat = stored.speech_feat
        elif prompt is None:
            if request.cross_lingual:
                raise InvalidInputError("cross_lingual needs a cloned voice (a prompt recording), not a speaker")
            speaker = llm_embedding = self.model.voices.embedding(request.voice).numpy()
            speech_tokens = llm_speech_tokens = no_tokens
            feat = np.zeros((0, self.model.config.mel_bins), dtype=np.float32)
        else:
            if prompt.family != family.name:
                raise InvalidInputError(
                    f"voice {request.voice!r} was prepared for {prompt.family} models; this model is {family.name}: "
                    "register the voice again for this model"
                )
            speaker = llm_embedding = prompt.embedding
            speech_tokens = llm_speech_tokens = prompt.speech_tokens
            feat = prompt.speech_feat
        # A text already holding <|endofprompt|> carries its own prompt (official callers write it in the text).
        system_text = "" if ENDOFPROMPT in request.text else rules.system_text()
        text_lead = ""
        if request.instruct_text is not None:
            # instruct (v1) and instruct2: the instruction in the official form, not normalised (official
            # `inference_instruct` normalises it, which its <|endofprompt|> turns off)
            prompt_text_tokens = frontend.tokenize(rules.instruction_prompt(request.instruct_text))
            llm_speech_tokens = no_tokens
            if not rules.instruct_keeps_voice_prompt:  # v1 Instruct: no LLM speaker embedding, no prompt speech at all
                llm_embedding, speech_tokens, feat = None, no_tokens, feat[:0]
        elif request.cross_lingual:  # official: the system text leads the text to speak itself
            prompt_text_tokens, text_lead = [], system_text
            llm_speech_tokens = no_tokens
        elif prompt is not None:
            # normalised as officially, which leaves a transcript behind a system prompt as it is
            prompt_text_tokens = frontend.tokenize(frontend.normalize(rules.transcript_prompt(prompt.transcript)))
        elif stored is not None:
            prompt_text_tokens = stored.prompt_text_tokens  # written with the prompt by the official code
        else:  # a built-in speaker: the system text alone is the prompt text
            prompt_text_tokens = frontend.tokenize(system_text)
        return _VoiceConditioning(
            prompt_text_tokens=prompt_text_tokens,
            text_lead_tokens=frontend.tokenize(text_lead),
            llm_embedding=llm_embedding,
            flow_embedding=speaker,
            llm_prompt_speech_tokens=llm_speech_tokens,
            flow_prompt_speech_tokens=speech_tokens,
            prompt_feat=feat,
        )

    def _encode_batch(self, token_lists: list[list[int]]) -> list[np.ndarray]:
        """The sentences through the text encoder in padded batches (`encoder_batches`) -> [T_i, D] float32 each."""
        device = self.model.text_device
        encoded_rows: list[np.ndarray] = []
        for batch in encoder_batches([len(tokens) for tokens in token_lists], ENCODER_BATCH_TOKEN_PAIRS):
            rows = token_lists[batch]
            lengths = torch.tensor([len(tokens) for tokens in rows], device=device)
            ids = pad_sequence([torch.tensor(tokens, dtype=torch.long) for tokens in rows], batch_first=True)
            encoded = self.model.text_llm.encode_text(ids.to(device), lengths).float().cpu().numpy()
            encoded_rows += [encoded[i, :length] for i, length in enumerate(lengths.tolist())]
        return encoded_rows


def _check_sentence_tokens(count: int, what: str) -> None:
    if count > MAX_SENTENCE_TOKENS:
        raise TextTooLongError(
            f"{what} is {count} tokens long; the limit is {MAX_SENTENCE_TOKENS}: end sentences with punctuation (a "
            "sentence is cut at its marks), or send a shorter instruction or transcript"
        )


def _checked_array(name: str, value: object, shape: tuple[int | None, ...], integer: bool = False) -> np.ndarray:
    """`value` as an array of `shape` (None: any size), of integers or of finite floats; else InvalidInputError."""
    if not isinstance(value, np.ndarray) or value.ndim != len(shape):
        raise InvalidInputError(f"{name} must be a {len(shape)}-d array")
    if any(want is not None and have != want for have, want in zip(value.shape, shape, strict=True)):
        raise InvalidInputError(f"{name} must have shape {shape}, got {value.shape}")
    if integer and not np.issubdtype(value.dtype, np.integer):
        raise InvalidInputError(f"{name} must hold integers, got {value.dtype}")
    if not integer and not (np.issubdtype(value.dtype, np.floating) and np.isfinite(value).all()):
        raise InvalidInputError(f"{name} must hold finite floats")
    return value


HEALTH_CHECK_MEL_FRAMES = 4  # enough for every conv of the vocoder, negligible time


class SpeechDecoderStage:
    """Speech-token generation, flow matching and vocoder over a batch of encoded segments."""

    def __init__(self, model: LoadedModel, prompt_cache: PromptCache | None = None) -> None:
        self.model = model
        self.prompt_cache = prompt_cache  # None: every request's prompt is prepared anew

    @property
    def sample_rate(self) -> int:
        return self.model.config.sample_rate

    def check_segment(self, segment: EncodedSegment) -> None:
        """InvalidInputError unless `segment` is what this decoder can take: the encoder's output for this model,
        every number finite and in bounds, every size within the decoder's. A decoder checks every segment it is
        given (callers may skip the HTTP layer; an unpickled object skipped its constructors' checks)."""
        config = self.model.config
        if not isinstance(segment, EncodedSegment):
            raise InvalidInputError(f"a segment must be an EncodedSegment, got {type(segment).__name__}")
        if not isinstance(segment.sampling, SamplingOptions):
            raise InvalidInputError("segment.sampling must be SamplingOptions")
        segment.sampling.check()
        if segment.sampling.seed is None:
            raise InvalidInputError("segment.sampling.seed must be set (the encoder draws one)")
        speed = segment.speed
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
            raise InvalidInputError(f"speed must be a number between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}")
        text_rows = _checked_array("text_encoded", segment.text_encoded, (None, self.model.llm.cfg.llm_input_size))
        if not 1 <= len(text_rows) <= MAX_SEGMENT_TEXT_TOKENS:
            raise InvalidInputError(f"text_encoded must have 1 to {MAX_SEGMENT_TEXT_TOKENS} rows, got {len(text_rows)}")
        text_len = segment.text_len
        if isinstance(text_len, bool) or not isinstance(text_len, int) or not 1 <= text_len <= len(text_rows):
            raise InvalidInputError(f"text_len must be an integer in [1, {len(text_rows)}], got {text_len!r}")
        if segment.llm_embedding is not None and segment.llm_embedding.size:
            _checked_array("llm_embedding", segment.llm_embedding, (config.spk_embed_dim,))
        _checked_array("flow_embedding", segment.flow_embedding, (config.spk_embed_dim,))
        for name in ("llm_prompt_speech_tokens", "flow_prompt_speech_tokens"):
            tokens = _checked_array(name, getattr(segment, name), (None,), integer=True)
            if len(tokens) > MAX_PROMPT_SPEECH_TOKENS:
                raise InvalidInputError(f"{name} has {len(tokens)} tokens; at most {MAX_PROMPT_SPEECH_TOKENS}")
            if tokens.size and not 0 <= int(tokens.min()) <= int(tokens.max()) < self.model.llm.eos:
                raise InvalidInputError(f"{name} must be in [0, {self.model.llm.eos})")
        frames = _checked_array("prompt_feat", segment.prompt_feat, (None, config.mel_bins))
        if len(frames) > MAX_PROMPT_MEL_FRAMES:
            raise InvalidInputError(f"prompt_feat must have at most {MAX_PROMPT_MEL_FRAMES} frames, got {len(frames)}")
        for name in ("voice", "prompt_key"):
            value = getattr(segment, name)
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= MAX_VOICE_KEY_CHARS):
                raise InvalidInputError(f"{name} must be None or a string of 1 to {MAX_VOICE_KEY_CHARS} characters")

    @torch.inference_mode()
    def decode_batch(self, segments: list[EncodedSegment]) -> list[np.ndarray | NonFiniteOutputError]:
        """Whole-utterance synthesis of a batch: one waveform [N] float32 per segment, or its error."""
        tokens = self.generate_tokens(segments)
        mels = self.tokens_to_mel(segments, tokens)
        return self.vocode(segments, mels)

    def generation_requests(self, segments: list[EncodedSegment]) -> list[GenerationRequest]:
        """The LLM requests of `segments`; a segment in a voice whose prepared prompt is cached (or is prepared and
        cached now) starts from its prompt prefix."""
        return [self._generation_request(segment) for segment in segments]

    def _generation_request(self, segment: EncodedSegment) -> GenerationRequest:
        device = self.model.decoder_device
        key = self._prompt_key(segment)
        prepared = None if key is None else self.prompt_cache.get(key)
        request = GenerationRequest(
            text_encoded=_tensor(segment.text_encoded, device),
            text_len=segment.text_len,
            embedding=None if segment.llm_embedding is None else _tensor(segment.llm_embedding, device),
            prompt_speech_tokens=_tensor(segment.llm_prompt_speech_tokens, device),
            options=segment.sampling,
        )
        if prepared is not None:
            return replace(
                request,
                embedding=prepared.llm_embedding,
                prompt_speech_tokens=prepared.llm_prompt_speech_tokens,
                prefix=prepared.prefix,
            )
        if key is None:
            return request
        # A miss prepares the prompt and starts from its prefix too, so that a hit computes exactly what a miss did.
        prepared = PreparedPrompt(
            prefix=prefill_prompt_prefix(self.model.llm, request),
            llm_prompt_speech_tokens=request.prompt_speech_tokens,
            llm_embedding=request.embedding,
            flow_prompt_speech_tokens=_tensor(segment.flow_prompt_speech_tokens, device),
            prompt_feat=_tensor(segment.prompt_feat, device),
            flow_embedding=_tensor(segment.flow_embedding, device),
        )
        self.prompt_cache.put(key, prepared)
        return replace(request, prefix=prepared.prefix)

    def _prompt_key(self, segment: EncodedSegment) -> PromptKey | None:
        if self.prompt_cache is None or not self.prompt_cache.max_bytes:
            return None
        if segment.voice is None or segment.prompt_key is None:
            return None
        return segment.voice, segment.prompt_key

    def flow_request(self, segment: EncodedSegment, tokens: torch.Tensor) -> FlowRequest:
        """The flow's request for `tokens` of `segment`: the prompt tensors already on the device when its voice's
        prepared prompt is cached (not counted as a hit or a miss: the LLM's lookup was)."""
        device = self.model.decoder_device
        key = self._prompt_key(segment)
        prepared = None if key is None else self.prompt_cache.get(key, count=False)
        if prepared is not None:
            return FlowRequest(
                tokens=tokens.to(device),
                prompt_tokens=prepared.flow_prompt_speech_tokens,
                prompt_feat=prepared.prompt_feat,
                embedding=prepared.flow_embedding,
                seed=segment.sampling.seed,
            )
        return FlowRequest(
            tokens=tokens.to(device),
            prompt_tokens=_tensor(segment.flow_prompt_speech_tokens, device),
            prompt_feat=_tensor(segment.prompt_feat, device),
            embedding=_tensor(segment.flow_embedding, device),
            seed=segment.sampling.seed,
        )

    def generate_tokens(self, segments: list[EncodedSegment]) -> list[torch.Tensor]:
        return self.model.llm.generate(self.generation_requests(segments))

    def tokens_to_mel(self, segments: list[EncodedSegment], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """The mel of each segment's LLM tokens (the family's long silent runs dropped first, as officially).

        The LLM may stop before its first token: such a segment gets an empty mel [mel_bins, 0] (no flow call), and
        so no audio, as its stream would.
        """
        flow_tokens = [self.flow_tokens(t) for t in tokens]
        spoken = [i for i, t in enumerate(flow_tokens) if len(t)]
        requests = [self.flow_request(segments[i], flow_tokens[i]) for i in spoken]
        mels = [torch.zeros(self.model.config.mel_bins, 0, dtype=self.model.dtype) for _ in segments]
        for i, mel in zip(spoken, self.model.flow.inference(requests) if requests else [], strict=True):
            mels[i] = self.apply_speed(mel, segments[i].speed)
        return mels

    def flow_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The LLM's tokens [N] as the flow gets them: the official `llm_job` drops the family's silent tokens
        past a run of 5 (streaming drops the same ones, token by token)."""
        silent = self.model.config.family.silent_tokens
        if not silent:
            return tokens
        return torch.tensor(SilentRunFilter(silent).filter(tokens.tolist()), dtype=torch.long)

    @staticmethod
    def apply_speed(mel: torch.Tensor, speed: float) -> torch.Tensor:
        """Official v1 speed control: stretch the mel [80, T] in time by 1/speed (linear interpolation)."""
        if speed == 1.0 or mel.shape[-1] == 0:
            return mel
        frames = max(1, int(mel.shape[-1] / speed))
        return F.interpolate(mel[None].float(), size=frames, mode="linear")[0].to(mel.dtype)

    @torch.inference_mode()
    def check_health(self) -> None:
        """A tiny vocoder pass on the decoder's device, waited for, so a device fault (a CUDA error) raises here.

        Its output is not judged: weights that give NaN fail each request with a message (500), not the replica.
        """
        hift = self.model.hift
        mel = torch.zeros(hift.config.in_channels, HEALTH_CHECK_MEL_FRAMES, dtype=self.model.dtype)
        hift.inference([mel.to(self.model.decoder_device)], seeds=[0])
        if self.model.decoder_device.type == "cuda":
            torch.cuda.synchronize(self.model.decoder_device)

    def open_bistream(self, start: BistreamStart) -> BistreamSynthesis:
        """One bi-streamed utterance (CosyVoice2/3): push text ids piece by piece, then finish (runtime.bistream)."""
        return BistreamSynthesis(self, start)

    def open_stream(self, segments: list[EncodedSegment]) -> DecodeStream:
        """Streaming synthesis of a batch: iterate the returned `DecodeStream` (see engine.runtime.streaming)."""
        return DecodeStream(self, segments)

    def vocode(
        self, segments: list[EncodedSegment], mels: list[torch.Tensor]
    ) -> list[np.ndarray | NonFiniteOutputError]:
        """One waveform [N] float32 per mel, or its error; an empty mel gives empty audio (no vocoder call)."""
        voiced = [i for i, mel in enumerate(mels) if mel.shape[-1]]
        waves = [torch.zeros(0) for _ in mels]
        if voiced:
            made = self.model.hift.inference(
                [mels[i] for i in voiced], seeds=[segments[i].sampling.seed for i in voiced]
            )
            for i, wave in zip(voiced, made, strict=True):
                waves[i] = wave
        results: list[np.ndarray | NonFiniteOutputError] = []
        for wave in waves:
            audio = wave.float().cpu().numpy()
            if not np.isfinite(audio).all():
                results.append(NonFiniteOutputError("the vocoder produced NaN or inf samples; no audio returned"))
            else:
                results.append(audio)
        return results


class CosyVoice:
    """Single-process TTS: `synthesize(text, voice) -> (waveform float32 [N], sample_rate)`."""

    def __init__(self, model: LoadedModel) -> None:
        self.encoder = TextEncoderStage(model)
        self.decoder = SpeechDecoderStage(model)

    @classmethod
    def load(cls, source: str = "tiny", **kwargs) -> CosyVoice:
        """`source`: an official model directory, or `dummy` / `tiny` (see `engine.loading.loader.load_model`)."""
        return cls(load_model(source, **kwargs))

    @property
    def voices(self) -> list[str]:
        return self.encoder.voices

    @property
    def sample_rate(self) -> int:
        return self.decoder.sample_rate

    def synthesize(self, text: str, voice: str, **options) -> tuple[np.ndarray, int]:
        """Synthesise `text` in `voice`; sentences are decoded as one batch and joined in order."""
        sampling_keys = set(SamplingOptions.__dataclass_fields__)
        sampling = SamplingOptions(**{k: v for k, v in options.items() if k in sampling_keys})
        rest = {k: v for k, v in options.items() if k not in sampling_keys}
        request = SynthesisRequest(text=text, voice=voice, sampling=sampling, **rest)
        results = self.decoder.decode_batch(self.encoder.encode(request))
        for result in results:
            if isinstance(result, Exception):
                raise result
        return np.concatenate(results), self.sample_rate

    def bistream(self, pieces: Iterable[str], voice: str, **options) -> Iterator[np.ndarray]:
        """Bi-streaming (CosyVoice2/3): the text comes as `pieces` (an iterator may wait for each); the audio chunks
        as they are made, the first ones while the text is still coming. Options as `synthesize`."""
        sampling_keys = set(SamplingOptions.__dataclass_fields__)
        sampling = SamplingOptions(**{k: v for k, v in options.items() if k in sampling_keys})
        rest = {k: v for k, v in options.items() if k not in sampling_keys}
        start = self.encoder.bistream_start(SynthesisRequest(text="", voice=voice, sampling=sampling, **rest))
        synthesis = self.decoder.open_bistream(start)
        for piece in pieces:
            yield from synthesis.push_text(self.encoder.text_piece_tokens(piece))
        yield from synthesis.finish()
