"""The CosyVoice v1 speech-token language model (`TransformerLM`), split into the two serving halves.

- Encoder side (CPU replicas): `TransformerLM.encode_text` = text_embedding -> causal Conformer text encoder ->
  text_encoder_affine_layer, over concat(prompt text, text).
- Decoder side: `TokenGenerator` decodes speech tokens from already-encoded text with a KV cache, batched and
  step-wise, so requests can join and leave between steps (continuous batching); `TransformerLM.generate` runs
  a list of requests to completion on top of it.

The generator drives any `SpeechTokenLM`: this v1 model and the CosyVoice2 `Qwen2LM` (engine/qwen2_llm.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.conformer import EncoderConfig, KVCache, RelPositionEncoder
from engine.errors import CheckpointError, InvalidInputError
from engine.layers import Linear, log_softmax_fp32
from engine.sampling import SamplingOptions, make_generator, sample_token
from engine.yaml_config import ObjectSpec, expect_class

SOS, TASK_ID = 0, 1  # rows of llm_embedding


@dataclass(frozen=True)
class LLMConfig:
    text_encoder_input_size: int
    llm_input_size: int
    llm_output_size: int
    text_token_size: int
    speech_token_size: int  # also the EOS id: llm_decoder has speech_token_size + 1 outputs
    spk_embed_dim: int
    text_encoder: EncoderConfig
    llm: EncoderConfig
    sampling: SamplingOptions  # the yaml's sampler settings: the default of requests that bring none

    @classmethod
    def from_yaml(cls, spec: ObjectSpec) -> LLMConfig:
        """The yaml `llm` node (class `TransformerLM`)."""
        expect_class(spec, "TransformerLM", "llm")
        for key in ("text_encoder_input_size", "llm_input_size", "llm_output_size", "text_token_size"):
            if key not in spec.kwargs:
                raise CheckpointError(f"the TransformerLM config has no {key}")
        text_encoder = EncoderConfig.from_yaml(spec["text_encoder"], spec["text_encoder_input_size"])
        llm = EncoderConfig.from_yaml(spec["llm"], spec["llm_input_size"])
        if text_encoder.input_size != spec["text_encoder_input_size"] or llm.input_size != spec["llm_input_size"]:
            raise CheckpointError("the TransformerLM encoders' input sizes disagree with its own")
        if llm.output_size != spec["llm_output_size"]:
            raise CheckpointError(f"llm output_size {llm.output_size} disagrees with llm_output_size")
        if not llm.causal:
            raise CheckpointError("the TransformerLM backbone must be causal (static_chunk_size: 1)")
        return cls(
            text_encoder_input_size=int(spec["text_encoder_input_size"]),
            llm_input_size=int(spec["llm_input_size"]),
            llm_output_size=int(spec["llm_output_size"]),
            text_token_size=int(spec["text_token_size"]),
            speech_token_size=int(spec.get("speech_token_size", 4096)),
            spk_embed_dim=int(spec.get("spk_embed_dim", 192)),
            text_encoder=text_encoder,
            llm=llm,
            sampling=sampling_from_yaml(spec.get("sampling")),
        )

    def kv_cache_bytes_per_position(self, dtype_bytes: int) -> int:
        """Bytes of keys and values one sequence position holds in the backbone's attention cache."""
        return 2 * self.llm.num_blocks * self.llm.output_size * dtype_bytes


def sampling_from_yaml(sampler: object) -> SamplingOptions:
    """The llm node's `sampling` (a `ras_sampling` partial) as the default options; the defaults when absent."""
    sampling = SamplingOptions()
    if isinstance(sampler, ObjectSpec):
        if sampler.class_name != "ras_sampling":
            raise CheckpointError(f"llm sampling {sampler.target!r} is not supported; only ras_sampling")
        keys = ("top_p", "top_k", "win_size", "tau_r")
        try:
            sampling = replace(sampling, **{k: sampler[k] for k in keys if k in sampler.kwargs})
        except InvalidInputError as exc:
            raise CheckpointError(f"llm sampling config: {exc.message}") from exc
    return sampling


@dataclass
class GenerationRequest:
    """One utterance to decode. `text_encoded` comes from `encode_text` over (prompt text + text)."""

    text_encoded: Tensor  # [T, llm_input_size]
    text_len: int  # target text tokens only, without the prompt: sets min/max length
    embedding: Tensor | None = None  # [spk_embed_dim] or [1, spk_embed_dim]; None or 0 rows: no speaker term
    prompt_speech_tokens: Tensor | None = None  # [P] speech tokens of the prompt
    options: SamplingOptions | None = None  # None: the model config's sampler settings


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


class TransformerLM(nn.Module):
    """Module and parameter names follow the official class, so `llm.pt` loads strictly."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.text_embedding = nn.Embedding(cfg.text_token_size, cfg.text_encoder_input_size)
        self.text_encoder = RelPositionEncoder(cfg.text_encoder)
        self.text_encoder_affine_layer = Linear(cfg.text_encoder.output_size, cfg.llm_input_size)
        self.llm_embedding = nn.Embedding(2, cfg.llm_input_size)
        self.llm = RelPositionEncoder(cfg.llm)
        self.llm_decoder = Linear(cfg.llm_output_size, cfg.speech_token_size + 1)
        self.speech_embedding = nn.Embedding(cfg.speech_token_size, cfg.llm_input_size)
        self.spk_embed_affine_layer = Linear(cfg.spk_embed_dim, cfg.llm_input_size)

    @property
    def eos(self) -> int:
        return self.cfg.speech_token_size

    @property
    def speaker_embed_dim(self) -> int | None:
        return self.cfg.spk_embed_dim

    def encode_text(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """tokens [B, T] (right-padded ids of prompt text + text), lengths [B] -> [B, T, llm_input_size]."""
        if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < self.cfg.text_token_size:
            raise InvalidInputError(f"text token ids must be in [0, {self.cfg.text_token_size})")
        x = self.text_embedding(tokens.long())
        return self.text_encoder_affine_layer(self.text_encoder(x, lengths))

    def lm_input(self, request: GenerationRequest) -> Tensor:
        """The prefill sequence [S, llm_input_size]: sos, speaker term, encoded text, task id, prompt speech."""
        weight = self.llm_embedding.weight
        parts = [weight[SOS : SOS + 1]]
        embedding = request.embedding
        if embedding is not None and embedding.numel():
            unit = F.normalize(embedding.reshape(1, -1).float().to(weight.device), dim=1)
            parts.append(self.spk_embed_affine_layer(unit))
        parts += [request.text_encoded.to(weight.device), weight[TASK_ID : TASK_ID + 1]]
        if request.prompt_speech_tokens is not None:
            parts.append(self.speech_embedding(request.prompt_speech_tokens.long().to(weight.device).reshape(-1)))
        return torch.cat([part.to(weight.dtype) for part in parts])

    def generate(self, requests: list[GenerationRequest]) -> list[Tensor]:
        """Decode all requests as one batch -> one LongTensor [N_i] of speech tokens each, in request order."""
        return generate_tokens(self, requests)


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

    def pause(self, request_id: int, keep_cache: bool) -> None:
        """Take an active request out of the batch between steps, until `resume`: its KV cache rows are set aside
        (`keep_cache`), or dropped and recomputed from its prompt and tokens on resume (vLLM's recompute
        preemption). Either way it resumes with the tokens it would have had unpaused (up to float rounding)."""
        for index, sequence in enumerate(self._pending):
            if sequence.request_id == request_id:  # not prefilled yet: nothing to keep
                del self._pending[index]
                self._paused[request_id] = (sequence, None)
                return
        [row] = [i for i, s in enumerate(self._running) if s.request_id == request_id]
        cache = self._cache.take([row]) if keep_cache else None
        self._paused[request_id] = (self._running[row], cache)
        self._retain([i for i in range(len(self._running)) if i != row])

    def resume(self, request_id: int) -> None:
        """A paused request rejoins the batch: it gets its next token in the next `step`."""
        sequence, cache = self._paused.pop(request_id)
        if cache is None:
            self._pending.append(sequence)  # prefilled again over its prompt and its tokens so far
        else:
            self._cache = cache if self._cache is None else KVCache.concat(self._cache, cache)
            self._running.append(sequence)

    @property
    def paused(self) -> int:
        return len(self._paused)

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """One token (or the stop) for every active request, running requests first, then the newly joined.

        A fault that one request's own input causes (its prefill or its sampling raises) ends that request alone,
        with an "error" event; a fault of the running batch's decoding step, which no single request explains,
        raises."""
        model = self.model
        events: list[TokenEvent] = []
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
            self._cache = joined_cache if self._cache is None else KVCache.concat(self._cache, joined_cache)
            self._running += joined
        if not hidden:
            return events
        logprobs = log_softmax_fp32(model.llm_decoder(torch.cat(hidden))).cpu()
        keep = []
        for row, sequence in enumerate(self._running):
            scores = logprobs[row]
            try:
                token = self._sample(sequence, scores)
            except Exception as exc:
                events.append(TokenEvent(sequence.request_id, None, "error", None, exc))
                continue
            if token >= model.eos:
                events.append(TokenEvent(sequence.request_id, None, "eos", scores))
                continue
            sequence.tokens.append(token)
            finished = len(sequence.tokens) >= sequence.max_len
            events.append(TokenEvent(sequence.request_id, token, "max_len" if finished else None, scores))
            if not finished:
                keep.append(row)
        self._retain(keep)
        return events

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
        the ones that fail alone leave with an "error" event, the others are prefilled together again."""
        pending, self._pending = self._pending, []
        if not pending:
            return [], None, None
        try:
            return pending, *self._prefill(pending)
        except Exception as exc:
            failed = {pending[0].request_id: exc} if len(pending) == 1 else {}
        for sequence in pending if not failed else ():
            try:
                self._prefill([sequence])
            except Exception as exc:
                failed[sequence.request_id] = exc
        events += [TokenEvent(i, None, "error", None, exc) for i, exc in failed.items()]
        joined = [s for s in pending if s.request_id not in failed]
        if not joined:  # (when every one prefills alone but not together, the retry below raises: not theirs)
            return [], None, None
        return joined, *self._prefill(joined)

    def _prefill(self, sequences: list[_Sequence]) -> tuple[Tensor, KVCache]:
        """Prefill requests (left-padded) into a cache of their own -> (last hidden [N, D], cache). A request resumed
        without its cache is prefilled over its prompt and the tokens it has so far."""
        inputs = [self._prefill_input(s) for s in sequences]
        width = max(len(x) for x in inputs)
        padded = torch.stack([F.pad(x, (0, 0, width - len(x), 0)) for x in inputs])
        columns = torch.arange(width, device=padded.device)
        valid = columns >= torch.tensor([width - len(x) for x in inputs], device=padded.device)[:, None]
        cache = self.model.llm.new_cache(len(inputs), padded.device)
        hidden = self.model.llm.forward_incremental(padded, valid, cache)[:, -1]
        return hidden, cache

    def _prefill_input(self, sequence: _Sequence) -> Tensor:
        """[S, D]: the request's prompt (`lm_input`), then its tokens so far (after a recompute pause)."""
        prompt = self.model.lm_input(sequence.request)
        if not sequence.tokens:
            return prompt
        weight = self.model.speech_embedding.weight
        tokens = torch.tensor(sequence.tokens, device=weight.device)
        return torch.cat([prompt, self.model.speech_embedding(tokens).to(prompt.dtype)])

    def _retain(self, rows: list[int]) -> None:
        """Keep these running rows (finished or cancelled ones leave the batch and the cache)."""
        if len(rows) == len(self._running):
            return
        self._running = [self._running[r] for r in rows]
        if not rows:
            self._cache = None
        else:
            self._cache.select(rows)
