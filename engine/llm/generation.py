"""Speech-token generation for any `SpeechTokenLM` (v1 `TransformerLM`, CosyVoice2 `Qwen2LM`, `CosyVoice3LM`).

`TokenGenerator` decodes speech tokens from already-encoded text with a KV cache, batched and step-wise, so
requests can join and leave between steps (continuous batching); `generate_tokens` runs a list of requests to
completion on top of it. `SilentRunFilter` passes tokens on to the flow as the official `llm_job` does.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import InvalidInputError
from engine.llm.sampling import SamplingOptions, make_generator, sample_token
from engine.nn.conformer import KVCache
from engine.nn.layers import log_softmax_fp32


@dataclass
class GenerationRequest:
    """One utterance to decode. `text_encoded` comes from `encode_text` over (prompt text + text)."""

    text_encoded: Tensor  # [T, llm_input_size]
    text_len: int  # target text tokens only, without the prompt: sets min/max length
    embedding: Tensor | None = None  # [spk_embed_dim] or [1, spk_embed_dim]; None or 0 rows: no speaker term
    prompt_speech_tokens: Tensor | None = None  # [P] speech tokens of the prompt
    options: SamplingOptions | None = None  # None: the model config's sampler settings
    prefix: PromptPrefix | None = None  # the KV cache over the first rows of `lm_input`, made once per voice prompt


@dataclass
class PromptPrefix:
    """The backbone's KV cache over the first `rows` rows of a request's `lm_input`, the rows its voice prompt alone
    fixes (`SpeechTokenLM.prompt_prefix_rows`): requests in the same voice prefill only the rows after them.
    `prefill_prompt_prefix` makes one; `TokenGenerator` reads it and never writes it (each request extends a copy)."""

    rows: int
    cache: KVCache  # one row, `rows` valid columns

    @property
    def nbytes(self) -> int:
        """Device bytes its keys, values and mask hold (spare columns included)."""
        tensors = [self.cache.valid, *self.cache.keys, *self.cache.values]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@torch.inference_mode()
def prefill_prompt_prefix(model: SpeechTokenLM, request: GenerationRequest) -> PromptPrefix | None:
    """The KV cache over the rows of `request`'s LM input that its voice prompt alone fixes; None when there are
    none."""
    rows = model.prompt_prefix_rows(request)
    if not rows:
        return None
    prefix = model.lm_input(request)[:rows][None]
    cache = model.llm.new_cache(1, prefix.device)
    model.llm.forward_incremental(prefix, torch.ones(1, rows, dtype=torch.bool, device=prefix.device), cache)
    return PromptPrefix(rows, cache)


@dataclass
class TokenEvent:
    """What one `TokenGenerator.step` produced for one request."""

    request_id: int
    token: int | None  # None when the request stopped on a stop token (EOS or above; never yielded), or failed
    finish_reason: str | None  # "eos", "max_len" or "error" when this was the request's last step, else None
    logprobs: Tensor | None  # [llm_decoder outputs] fp32: the scores sampled from (log-softmax, EOS -inf before
    # min_len); None for an error
    error: Exception | None = None  # finish_reason "error": what failed for this request alone; it left the batch


MAX_SILENT_RUN = 5  # the official llm_job's max_silent_token_num


@dataclass
class SilentRunFilter:
    """What the official `llm_job` passes from the LLM to the flow: a silent token (one of `silent_tokens`, the
    family's silent/breath codes) is dropped once more than MAX_SILENT_RUN of them come in a row. The LLM itself
    still sees every token it sampled."""

    silent_tokens: frozenset[int]
    run: int = 0  # silent tokens in a row so far

    def keep(self, token: int) -> bool:
        """Whether the flow gets `token`, the next one the LLM yielded."""
        self.run = self.run + 1 if token in self.silent_tokens else 0
        return self.run <= MAX_SILENT_RUN

    def filter(self, tokens: list[int]) -> list[int]:
        return [token for token in tokens if self.keep(token)]


class DecodingConfig(Protocol):
    llm_input_size: int
    sampling: SamplingOptions  # the default of requests that bring no options


class IncrementalBackbone(Protocol):
    def new_cache(self, batch: int, device: torch.device | str = "cpu") -> KVCache: ...

    def forward_incremental(self, x: Tensor, valid: Tensor, cache: KVCache) -> Tensor: ...


class SpeechTokenLM(Protocol):
    """What `TokenGenerator` needs of a speech-token LM (`TransformerLM`, `Qwen2LM`)."""

    cfg: DecodingConfig
    llm: IncrementalBackbone
    speech_embedding: nn.Embedding  # the next step's input is the embedding of the token just sampled
    llm_decoder: nn.Module

    @property
    def eos(self) -> int:
        """The EOS id (= speech_token_size); every sampled id >= eos stops the request."""

    @property
    def speaker_embed_dim(self) -> int | None:
        """Size of the speaker embedding the LM takes; None when it takes none (a given one is ignored)."""

    def lm_input(self, request: GenerationRequest) -> Tensor: ...

    def prompt_prefix_rows(self, request: GenerationRequest) -> int:
        """How many leading rows of `lm_input(request)` depend on its voice prompt alone (the same for every text
        spoken in that voice), so that their KV cache can be kept and reused; 0 when none are worth keeping."""


def generate_tokens(model: SpeechTokenLM, requests: list[GenerationRequest]) -> list[Tensor]:
    """Decode all requests as one batch -> one LongTensor [N_i] of speech tokens each, in request order."""
    generator = TokenGenerator(model)
    ids = [generator.add(request) for request in requests]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while generator.active:
        for event in generator.step():
            if event.error is not None:
                raise event.error
            if event.token is not None:
                tokens[event.request_id].append(event.token)
    return [torch.tensor(tokens[i], dtype=torch.long) for i in ids]


@dataclass
class _Sequence:
    request_id: int
    request: GenerationRequest
    options: SamplingOptions
    generator: torch.Generator
    min_len: int
    max_len: int
    tokens: list[int] = field(default_factory=list)


class TokenGenerator:
    """Continuous-batching decoder: `add` requests at any time, `step` advances every active one by a token.

    Requests added since the last step are prefilled together (left-padded) in the next step and join the running
    batch; finished and cancelled requests leave it. Sampling runs per request on the CPU with its own seeded
    generator, on the same log-probabilities it would get alone (up to float rounding).

    Running out of device memory (`torch.cuda.OutOfMemoryError`) loses no request: a step that runs out before it
    samples is undone and raises (the caller makes room and steps again; no sampler has moved), and a batch that
    has no room to shrink its KV cache drops it and prefills its requests again at the next step.
    """

    def __init__(self, model: SpeechTokenLM) -> None:
        self.model = model
        self._pending: list[_Sequence] = []
        self._running: list[_Sequence] = []  # row i of the cache is self._running[i]
        self._paused: dict[int, tuple[_Sequence, KVCache | None]] = {}  # by id: its cache rows, None to recompute
        self._cache: KVCache | None = None
        self._next_id = 0

    @property
    def active(self) -> int:
        """Requests added and not yet finished, cancelled or paused."""
        return len(self._pending) + len(self._running)

    @property
    def batch_size(self) -> int:
        """Sequences holding a row of the KV cache (running, not pending)."""
        return len(self._running)

    def add(self, request: GenerationRequest) -> int:
        """Queue a request (validated here); it gets its first token in the next `step`. -> request id."""
        cfg = self.model.cfg
        encoded, text_len = request.text_encoded, request.text_len
        if encoded.dim() != 2 or encoded.shape[1] != cfg.llm_input_size or not len(encoded):
            raise InvalidInputError(f"text_encoded must be [T >= 1, {cfg.llm_input_size}], got {tuple(encoded.shape)}")
        if isinstance(text_len, bool) or not isinstance(text_len, int) or not 1 <= text_len <= len(encoded):
            raise InvalidInputError(f"text_len must be an integer in [1, {len(encoded)}], got {text_len!r}")
        embed_dim = self.model.speaker_embed_dim
        if embed_dim is not None and request.embedding is not None and request.embedding.numel() not in (0, embed_dim):
            raise InvalidInputError(f"the speaker embedding must have {embed_dim} values")
        prompt = request.prompt_speech_tokens
        if prompt is not None and prompt.numel() and not 0 <= int(prompt.min()) <= int(prompt.max()) < self.model.eos:
            raise InvalidInputError(f"prompt speech tokens must be in [0, {self.model.eos})")
        prefix = request.prefix
        if prefix is not None and not (
            prefix.cache.batch == 1 and prefix.cache.length == prefix.rows <= self.model.prompt_prefix_rows(request)
        ):
            raise InvalidInputError("the prompt prefix does not cover rows of this request's voice prompt alone")
        options = request.options or cfg.sampling
        max_len = int(text_len * options.max_token_text_ratio)
        if max_len < 1:
            raise InvalidInputError(f"max_token_text_ratio {options.max_token_text_ratio} allows no speech tokens")
        sequence = _Sequence(
            request_id=self._next_id,
            request=request,
            options=options,
            generator=make_generator(options.seed),
            min_len=int(text_len * options.min_token_text_ratio),
            max_len=max_len,
        )
        self._next_id += 1
        self._pending.append(sequence)
        return sequence.request_id

    def cancel(self, request_id: int) -> bool:
        """Drop a request and free its batch slot; False if it is not active."""
        if self._paused.pop(request_id, None) is not None:
            return True
        for index, sequence in enumerate(self._pending):
            if sequence.request_id == request_id:
                del self._pending[index]
                return True
        rows = [i for i, s in enumerate(self._running) if s.request_id != request_id]
        if len(rows) == len(self._running):
            return False
        self._retain(rows)
        return True

    def pause(self, request_ids: Collection[int], keep_cache: bool) -> None:
        """Take active requests out of the batch between steps, until `resume`: their KV cache rows are set aside
        (`keep_cache`), or dropped and recomputed from their prompts and tokens on resume (vLLM's recompute
        preemption). Either way they resume with the tokens they would have had unpaused (up to float rounding).
        Pausing several in one call shrinks the batch's cache once."""
        wanted = set(request_ids)
        pending = [s for s in self._pending if s.request_id in wanted]  # not prefilled yet: nothing to keep
        rows = [i for i, s in enumerate(self._running) if s.request_id in wanted]
        if missing := wanted - {s.request_id for s in pending} - {self._running[i].request_id for i in rows}:
            raise KeyError(f"not active: {sorted(missing)}")
        caches = [self._cache.take([row]) if keep_cache else None for row in rows]  # out of memory here: no change
        for sequence in pending:
            self._pending.remove(sequence)
            self._paused[sequence.request_id] = (sequence, None)
        for row, cache in zip(rows, caches, strict=True):
            self._paused[self._running[row].request_id] = (self._running[row], cache)
        self._retain([i for i in range(len(self._running)) if i not in rows])

    def resume(self, request_ids: Collection[int]) -> None:
        """Paused requests rejoin the batch: they get their next token in the next `step`. Their kept cache rows are
        merged into the batch's in one copy; with no device memory for it, they are dropped and the requests
        prefilled again instead."""
        if missing := set(request_ids) - set(self._paused):
            raise KeyError(f"not paused: {sorted(missing)}")
        paused = [self._paused.pop(request_id) for request_id in request_ids]
        kept = [(sequence, cache) for sequence, cache in paused if cache is not None]
        self._pending += [sequence for sequence, cache in paused if cache is None]
        if not kept:
            return
        try:
            caches = [cache for _, cache in kept]
            self._cache = KVCache.concat(caches if self._cache is None else [self._cache, *caches])
            self._running += [sequence for sequence, _ in kept]
        except torch.cuda.OutOfMemoryError:
            self._pending += [sequence for sequence, _ in kept]  # prefilled again over their prompts and tokens so far

    @property
    def paused(self) -> int:
        return len(self._paused)

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """One token (or the stop) for every active request, running requests first, then the newly joined.

        A fault that one request's own input causes (its prefill or its sampling raises) ends that request alone,
        with an "error" event; a fault of the running batch's decoding step, which no single request explains,
        raises. Out of device memory before sampling, the generator is put back as it was before the step (the
        newly joined requests pending again) and the `torch.cuda.OutOfMemoryError` raises."""
        saved = self._pending, list(self._running), None if self._cache is None else self._cache.checkpoint()
        events: list[TokenEvent] = []
        try:
            logprobs = self._forward(events)
        except torch.cuda.OutOfMemoryError:
            self._pending, self._running, self._cache = saved
            raise
        if logprobs is None:
            return events
        keep = []
        for row, sequence in enumerate(self._running):
            scores = logprobs[row]
            try:
                token = self._sample(sequence, scores)
            except Exception as exc:
                events.append(TokenEvent(sequence.request_id, None, "error", None, exc))
                continue
            if token >= self.model.eos:
                events.append(TokenEvent(sequence.request_id, None, "eos", scores))
                continue
            sequence.tokens.append(token)
            finished = len(sequence.tokens) >= sequence.max_len
            events.append(TokenEvent(sequence.request_id, token, "max_len" if finished else None, scores))
            if not finished:
                keep.append(row)
        self._retain(keep)
        return events

    def _forward(self, events: list[TokenEvent]) -> Tensor | None:
        """Prefill the pending requests and run the running ones a step -> the log-probabilities of every running row
        (the joined ones last), on the CPU; None when nothing runs."""
        model = self.model
        joined, joined_hidden, joined_cache = self._prefill_pending(events)  # before the running rows move on
        hidden = []
        if self._running:
            weight = model.speech_embedding.weight
            last = torch.tensor([s.tokens[-1] for s in self._running], device=weight.device)
            x = model.speech_embedding(last)[:, None]
            valid = torch.ones(len(last), 1, dtype=torch.bool, device=weight.device)
            hidden.append(model.llm.forward_incremental(x, valid, self._cache)[:, -1])
        if joined:
            hidden.append(joined_hidden)
            self._cache = joined_cache if self._cache is None else KVCache.concat([self._cache, joined_cache])
            self._running += joined
        if not hidden:
            return None
        return log_softmax_fp32(model.llm_decoder(torch.cat(hidden))).cpu()

    def _sample(self, sequence: _Sequence, scores: Tensor) -> int:
        """The sequence's next token from its log-softmax scores [V] (stop ids masked in place before min_len)."""
        eos = self.model.eos
        if len(sequence.tokens) < sequence.min_len:
            # official: EOS only; v2 has two more stop ids after it, masked too on request
            last_masked = None if sequence.options.mask_all_stop_ids_before_min_len else eos + 1
            scores[eos:last_masked] = float("-inf")
        return sample_token(scores, sequence.tokens, sequence.options, sequence.generator)

    def _prefill_pending(self, events: list[TokenEvent]) -> tuple[list[_Sequence], Tensor | None, KVCache | None]:
        """Prefill the requests added since the last step -> (those that join, their last hidden [N, D], their cache).

        Nothing of the running batch is touched, so when the batch's prefill raises, each request is tried alone:
        the ones that fail alone leave with an "error" event, the others are prefilled together again. Running out
        of memory is no request's own fault: it raises."""
        pending, self._pending = self._pending, []
        if not pending:
            return [], None, None
        try:
            return self._prefill(pending)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:
            failed = {pending[0].request_id: exc} if len(pending) == 1 else {}
        for sequence in pending if not failed else ():
            try:
                self._prefill([sequence])
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as exc:
                failed[sequence.request_id] = exc
        events += [TokenEvent(i, None, "error", None, exc) for i, exc in failed.items()]
        joined = [s for s in pending if s.request_id not in failed]
        if not joined:  # (when every one prefills alone but not together, the retry below raises: not theirs)
            return [], None, None
        return self._prefill(joined)

    def _prefill(self, sequences: list[_Sequence]) -> tuple[list[_Sequence], Tensor, KVCache]:
        """Prefill requests into a cache of their own -> (the requests in the cache's row order, last hidden [N, D],
        cache). The requests without a prompt prefix are prefilled together (left-padded), then each one with a prefix
        alone, over the rows after it on a copy of its prefix's cache (their rows differ in length only by padding,
        which would fall between the prefix and the rest). A request resumed without its cache is prefilled over its
        prompt and the tokens it has so far."""
        plain = [s for s in sequences if s.request.prefix is None]
        parts: list[tuple[Tensor, KVCache]] = []
        if plain:
            inputs = [self._prefill_input(s) for s in plain]
            width = max(len(x) for x in inputs)
            padded = torch.stack([F.pad(x, (0, 0, width - len(x), 0)) for x in inputs])
            columns = torch.arange(width, device=padded.device)
            valid = columns >= torch.tensor([width - len(x) for x in inputs], device=padded.device)[:, None]
            cache = self.model.llm.new_cache(len(inputs), padded.device)
            parts.append((self.model.llm.forward_incremental(padded, valid, cache)[:, -1], cache))
        prefixed = [s for s in sequences if s.request.prefix is not None]
        for sequence in prefixed:
            prefix = sequence.request.prefix
            rest = self._prefill_input(sequence)[prefix.rows :][None]
            cache = prefix.cache.take([0])  # a copy: the prefix serves other requests
            valid = torch.ones(1, rest.shape[1], dtype=torch.bool, device=rest.device)
            parts.append((self.model.llm.forward_incremental(rest, valid, cache)[:, -1], cache))
        cache = KVCache.concat([cache for _, cache in parts])
        return plain + prefixed, torch.cat([hidden for hidden, _ in parts]), cache

    def _prefill_input(self, sequence: _Sequence) -> Tensor:
        """[S, D]: the request's prompt (`lm_input`), then its tokens so far (after a recompute pause)."""
        prompt = self.model.lm_input(sequence.request)
        if not sequence.tokens:
            return prompt
        weight = self.model.speech_embedding.weight
        tokens = torch.tensor(sequence.tokens, device=weight.device)
        return torch.cat([prompt, self.model.speech_embedding(tokens).to(prompt.dtype)])

    def _retain(self, rows: list[int]) -> None:
        """Keep these running rows (finished or cancelled ones leave the batch and the cache). Shrinking the cache
        copies the kept rows: with no memory for the copy, the cache is dropped and the kept requests are prefilled
        again over their tokens so far at the next step (as a recompute pause)."""
        if len(rows) == len(self._running):
            return
        kept = [self._running[r] for r in rows]
        if not rows:
            self._running, self._cache = [], None
            return
        try:
            self._cache.select(rows)
        except torch.cuda.OutOfMemoryError:
            self._running, self._cache, self._pending = [], None, kept + self._pending
            return
        self._running = kept
