"""The encoder side of serving (CPU): the text frontend, text encoding and voice features turn a request into
`EncodedSegment`s, plain numpy records the decoder side takes (`engine.runtime.decoder_stage`)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from engine.errors import InvalidInputError, TextTooLongError
from engine.llm.sampling import MAX_SEED
from engine.loading.loader import LoadedModel
from engine.runtime.bistream import BistreamStart, check_bistream
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import EncodingPlan, SegmentText, SynthesisRequest, VoiceConditioning
from engine.text.frontend import ENDOFPROMPT

if TYPE_CHECKING:
    from engine.voices.cloning import VoicePrompt

# The text ids of one sentence, its prompt included, that the text encoder takes: its attention's memory grows with
# their square (v1, measured on the tiny model: 25 MB at 512, 77 MB at 1024, 301 MB at 2048, 4.7 GB at 8192). A
# split sentence has at most ~80 tokens; only a long run of text without sentence marks comes near this.
MAX_SENTENCE_TOKENS = 1024
# Sentences encoded in one call at most: rows x longest row^2 (padding makes every row the longest) within what one
# sentence of MAX_SENTENCE_TOKENS may take, so a long sentence beside many short ones costs no more than alone.
ENCODER_BATCH_TOKEN_PAIRS = MAX_SENTENCE_TOKENS**2


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

    def _segment_texts(self, request: SynthesisRequest, voice: VoiceConditioning) -> list[SegmentText]:
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

    def _voice_conditioning(self, request: SynthesisRequest, prompt: VoicePrompt | None) -> VoiceConditioning:
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
        return VoiceConditioning(
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
