"""Token-level bi-streaming for the CosyVoice2/3 LMs (`Qwen2LM`, `CosyVoice3LM`): text joins the LM input as it arrives.

`BistreamDecoder` is the official `Qwen2LM.inference_bistream` as a push API: `push_text` adds the next text tokens
and returns the speech tokens that can be decoded with them; `finish` (no more text) decodes to the end. The LM input
interleaves text and speech in the family's mix ratio (5 text tokens to 15 speech tokens): after the prompt's groups,
every 15 decoded tokens the LM emits the unspoken fill token, which asks for the next 5 text tokens; at the end of
text the rest and the task id join and it decodes to the end token.

Not official: a special id the official loop would raise on is drawn again with those ids masked (so a dummy LM still
speaks), and decoding after the end of text stops at `max_token_text_ratio` times the text tokens pushed. A decoder
runs one sequence with its own KV cache, outside `TokenGenerator`'s batch. The protocol rule by rule, and what is
kept as officially: docs/models.md, "Bi-streaming: text joining the LM as it arrives".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import InvalidInputError
from engine.llm.qwen2_lm import embed_text
from engine.llm.sampling import SamplingOptions, make_generator, sample_token
from engine.nn.conformer import KVCache
from engine.nn.layers import log_softmax_fp32


class BistreamLM(Protocol):
    """What `BistreamDecoder` needs of an LM (`Qwen2LM`, `CosyVoice3LM`)."""

    cfg: object
    llm: nn.Module
    speech_embedding: nn.Embedding
    llm_decoder: nn.Module

    @property
    def eos(self) -> int:
        """speech_token_size: the first special id."""

    @property
    def fill_token(self) -> int: ...

    @property
    def end_token(self) -> int:
        """The id that ends a bi-streamed utterance."""

    @property
    def mix_ratio(self) -> tuple[int, int]: ...

    def special_embeddings(self) -> tuple[Tensor, Tensor]: ...

    def bistream_prompt_split(self, prompt_text: Tensor) -> int:
        """How many leading prompt text tokens go into the LM input before any speech (v3: through
        `<|endofprompt|>`)."""


class BistreamDecoder:
    """One bi-streamed utterance: `push_text` any number of times, then `finish` once.

    prompt_text [P] and prompt_speech_tokens [S] are ids (S may be 0); options: sampling (None: the model's).
    """

    @torch.inference_mode()
    def __init__(
        self,
        model: BistreamLM,
        prompt_text: Tensor,
        prompt_speech_tokens: Tensor | None = None,
        options: SamplingOptions | None = None,
    ) -> None:
        self.model = model
        self.options = options or model.cfg.sampling
        self.options.check()
        self.generator = make_generator(self.options.seed)
        weight = model.speech_embedding.weight
        self.device = weight.device
        prompt_text = prompt_text.reshape(-1).long().to(self.device)
        speech = torch.zeros(0, dtype=torch.long) if prompt_speech_tokens is None else prompt_speech_tokens
        speech = speech.reshape(-1).long().to(self.device)
        if speech.numel() and not 0 <= int(speech.min()) <= int(speech.max()) < model.eos:
            raise InvalidInputError(f"prompt speech tokens must be in [0, {model.eos})")
        split = model.bistream_prompt_split(prompt_text)
        sos, self.task_id = model.special_embeddings()
        self.input = torch.cat([sos, self._embed(prompt_text[:split])]).to(weight.dtype)  # rows not yet fed
        self.text = self._embed(prompt_text[split:])  # text rows waiting to join
        self.prompt_speech = model.speech_embedding(speech)  # prompt speech rows waiting to join
        self.cache = model.llm.new_cache(1, self.device)
        self.tokens: list[int] = []  # every id the LM produced, fill tokens included (the sampler's history)
        self.spoken = 0  # speech tokens returned
        self.text_pushed = 0
        self.finished = False  # the text has ended
        self._decoding = False
        self._limit = 0  # speech tokens at most once the text has ended
        ratio = model.mix_ratio[1]
        self.next_fill = (len(speech) // ratio + 1) * ratio - len(speech)

    def _embed(self, tokens: Tensor) -> Tensor:
        embed_tokens = self.model.llm.model.model.embed_tokens
        return embed_text(embed_tokens, tokens[None], torch.tensor([len(tokens)]))[0].to(
            self.model.speech_embedding.weight.dtype
        )

    def _sample(self, scores: Tensor, allowed: int) -> int:
        """The next id from scores [classes]: a speech token or the special id `allowed` (the fill token before the
        end of text, with id speech_token_size masked as officially; the end token after it)."""
        first_special = self.model.eos
        if allowed == self.model.fill_token:
            scores[first_special] = float("-inf")
        token = sample_token(scores, self.tokens, self.options, self.generator)
        if token < first_special or token == allowed:
            return token
        redraw = scores.clone()  # the official loop raises here
        redraw[first_special:] = float("-inf")
        redraw[allowed] = scores[allowed]
        return sample_token(redraw, self.tokens, self.options, self.generator)

    def _accept(self, token: int) -> None:
        self.tokens.append(token)
        self.spoken += 1
        self.input = self.model.speech_embedding.weight[token : token + 1]

    @property
    def decoding(self) -> bool:
        """Whether `step` decodes now: after `add_text` until the fill token, after `end_text` until the end."""
        return self._decoding

    @torch.inference_mode()
    def add_text(self, tokens: Tensor) -> None:
        """The next text token ids [N] (one piece): the LM decodes with them (`step`) if they complete what it waits
        for (the prompt's groups, or the next text group after a fill token)."""
        if self.finished:
            raise InvalidInputError("text was pushed after the end of the text")
        if self._decoding:
            raise InvalidInputError("a text piece was added while the LM was still decoding the last one")
        tokens = tokens.reshape(-1).long().to(self.device)
        self.text = torch.cat([self.text, self._embed(tokens)])
        self.text_pushed += len(tokens)
        model, (text_group, speech_group) = self.model, self.model.mix_ratio
        while len(self.prompt_speech) and len(self.text) >= text_group:
            self.input = torch.cat([self.input, self.text[:text_group], self.prompt_speech[:speech_group]])
            self.text, self.prompt_speech = self.text[text_group:], self.prompt_speech[speech_group:]
        if len(self.prompt_speech):
            return
        after_fill = bool(self.tokens) and self.tokens[-1] == model.fill_token
        if after_fill or (not self.tokens and self.cache.length == 0 and len(self.input) == 1):
            if len(self.text) < text_group:
                return
            joined = self.text[:text_group]
            self.input = joined if after_fill else torch.cat([self.input, joined])
            self.text = self.text[text_group:]
        self._decoding = True

    @torch.inference_mode()
    def end_text(self) -> None:
        """No more text: `step` decodes to the end token (or the length limit)."""
        if self.finished:
            raise InvalidInputError("the text has already ended")
        self.finished = True
        self.input = torch.cat([self.input, self.text, self.task_id.to(self.input.dtype)])
        self._limit = max(1, int(self.text_pushed * self.options.max_token_text_ratio))
        self._decoding = True

    def step(self) -> int | None:
        """One LM step while `decoding` -> the speech token decoded, or None when the step ended the decoding: a
        fill token (the LM waits for the next text piece) or, after the end of the text, the end token or limit."""
        [outcome] = step_together([self])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    @property
    def _at_limit(self) -> bool:
        return self.finished and self.spoken >= self._limit

    def _next(self, scores: Tensor | None) -> int | None:
        """What `step` returns, from the scores [classes] of the LM's forward over `self.input` (None: at the
        limit, where no forward runs)."""
        model = self.model
        if scores is None:
            self._decoding = False
            return None
        if self.finished:
            token = self._sample(scores, allowed=model.end_token)
            if token == model.end_token:
                self._decoding = False
                return None
        else:
            token = model.fill_token if len(self.tokens) == self.next_fill else self._sample(scores, model.fill_token)
            if token == model.fill_token:
                self.next_fill = len(self.tokens) + model.mix_ratio[1] + 1
                self.tokens.append(token)
                self._decoding = False
                return None
        self._accept(token)
        return token

    def push_text(self, tokens: Tensor) -> list[int]:
        """The next text token ids [N] -> the speech tokens decoded now (none while waiting for text)."""
        self.add_text(tokens)
        return list(self._decode())

    def finish(self) -> Iterator[int]:
        """No more text: the speech tokens to the end token (or the length limit), one at a time."""
        self.end_text()
        return self._decode()

    def _decode(self) -> Iterator[int]:
        while self._decoding:
            token = self.step()
            if token is not None:
                yield token


@torch.inference_mode()
def step_together(decoders: Sequence[BistreamDecoder]) -> list[int | Exception | None]:
    """One `step` of each of these decoders (each `decoding`, all of one model) -> what each step returns, in order,
    or the exception its step raised (the others' steps stand).

    The decoders past their prefill run their LM forward as one batch, their caches joined for it and split after;
    a batch forward that raises runs again one decoder at a time, so that an error is its own decoder's.
    """
    joined = [i for i, d in enumerate(decoders) if not d._at_limit and d.cache.length]
    scores: dict[int, Tensor] = {}
    if len(joined) > 1:
        try:
            scores = dict(zip(joined, _forward([decoders[i] for i in joined]), strict=True))
        except Exception:  # one decoder's state may be at fault: each runs alone below
            scores = {}
    outcomes: list[int | Exception | None] = []
    for i, decoder in enumerate(decoders):
        try:
            row = None if decoder._at_limit else scores[i] if i in scores else _forward([decoder])[0]
            outcomes.append(decoder._next(row))
        except Exception as exc:
            outcomes.append(exc)
        if not decoder.decoding and decoder.cache.shares_buffers:
            # It waits for text now, its cache a view holding a whole batch's buffers alive: its own row only.
            decoder.cache = decoder.cache.take([0])
    return outcomes


def _forward(decoders: Sequence[BistreamDecoder]) -> Tensor:
    """Feed each decoder's `input` to its LM (left-padded into one batch) -> the log-softmax scores [B, classes] (fp32,
    CPU) of each one's next id. The inputs stay as they are until `_next` replaces them (the official loop keeps one
    after a fill token); each decoder's cache is its row of the batch's afterwards."""
    model, device = decoders[0].model, decoders[0].device
    width = max(len(d.input) for d in decoders)
    x = torch.stack([F.pad(d.input, (0, 0, width - len(d.input), 0)) for d in decoders])
    valid = torch.stack([torch.arange(width, device=device) >= width - len(d.input) for d in decoders])
    cache = KVCache.concat([d.cache for d in decoders])
    hidden = model.llm.forward_incremental(x, valid, cache)[:, -1]
    scores = log_softmax_fp32(model.llm_decoder(hidden)).float().cpu()
    for decoder, part in zip(decoders, cache.split() if len(decoders) > 1 else [cache], strict=True):
        decoder.cache = part
    return scores
