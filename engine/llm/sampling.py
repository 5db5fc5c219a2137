"""Per-request speech-token sampling: the official repetition-aware sampler (VALL-E 2 RAS) and greedy argmax.

Everything runs on one sequence's log-softmax scores [V] on the CPU, with that request's own
`torch.Generator`, so a request draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from engine.errors import CheckpointError, InvalidInputError
from engine.loading.yaml_config import ObjectSpec

MAX_SEED = 2**63 - 1
# Bounds of the options a caller may set. The official defaults are 25, 10 and 2-20; past these bounds an option
# changes nothing audible but costs time (top_k and win_size are per-token work; the ratio bounds a sentence's length).
MAX_TOP_K = 10_000
MAX_WIN_SIZE = 1_000
MAX_TOKEN_TEXT_RATIO = 100.0


@dataclass(frozen=True)
class SamplingOptions:
    """How one request picks its speech tokens, and how long it may speak (in tokens per target text token)."""

    greedy: bool = False
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    seed: int | None = None
    # Official decoding masks only EOS before min_len, so a CosyVoice2 LM may still stop there on its two other
    # stop ids (speech_token_size + 1, + 2) and cut the speech short. True masks all three, which guarantees
    # min_len tokens; it is off by default to match the official outputs.
    mask_all_stop_ids_before_min_len: bool = False

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """InvalidInputError unless every option is of its type, finite and within its bounds. Run at construction
        and again by the decoder (an unpickled object skips `__post_init__`)."""

        def number(name: str, integer: bool = False) -> float:
            value = getattr(self, name)
            kinds = (int,) if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise InvalidInputError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidInputError(f"{name} must be a finite number, got {value!r}")
            if isinstance(value, int) and abs(value) > MAX_SEED:  # far out of every bound; too long to print
                raise InvalidInputError(f"{name} is out of range")
            return value

        for flag in ("greedy", "mask_all_stop_ids_before_min_len"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidInputError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if not 0.0 < number("top_p") <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 1 <= number("top_k", integer=True) <= MAX_TOP_K:
            raise InvalidInputError(f"top_k must be in [1, {MAX_TOP_K}], got {self.top_k}")
        if not 1 <= number("win_size", integer=True) <= MAX_WIN_SIZE:
            raise InvalidInputError(f"win_size must be in [1, {MAX_WIN_SIZE}], got {self.win_size}")
        if not 0.0 <= number("tau_r") <= 1.0:
            raise InvalidInputError(f"tau_r must be in [0, 1], got {self.tau_r}")
        if not 0 <= number("min_token_text_ratio") <= MAX_TOKEN_TEXT_RATIO:
            raise InvalidInputError(
                f"min_token_text_ratio must be in [0, {MAX_TOKEN_TEXT_RATIO}], got {self.min_token_text_ratio}"
            )
        if not 0 < number("max_token_text_ratio") <= MAX_TOKEN_TEXT_RATIO:
            raise InvalidInputError(
                f"max_token_text_ratio must be in (0, {MAX_TOKEN_TEXT_RATIO}], got {self.max_token_text_ratio}"
            )
        if self.max_token_text_ratio < self.min_token_text_ratio:
            raise InvalidInputError(
                f"max_token_text_ratio ({self.max_token_text_ratio}) must be >= min_token_text_ratio "
                f"({self.min_token_text_ratio})"
            )
        if self.seed is not None and not 0 <= number("seed", integer=True) <= MAX_SEED:
            raise InvalidInputError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed`, or with a fresh random seed when None."""
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)


def nucleus_sample(probs: Tensor, top_p: float, top_k: int, generator: torch.Generator) -> int:
    """Draw from the most likely tokens, taken in order while their summed probability is below top_p, at most
    top_k of them (so at least the most likely one). probs [V] -> token id."""
    # The official sampler stable-sorts the whole vocabulary (equal probabilities keep their id order, so draws
    # replay). Only the top_k can be drawn, so this sorts just the ids at or above the k-th largest probability
    # (ties included, in id order): the same order for those ids at a fraction of the cost.
    kth_largest = probs.topk(min(top_k, probs.numel())).values[-1]
    candidate_ids = (probs >= kth_largest).nonzero().squeeze(1)
    candidate_probs, order = probs[candidate_ids].sort(descending=True, stable=True)
    top_probs, top_ids = candidate_probs[:top_k], candidate_ids[order[:top_k]]
    mass_before = torch.cumsum(top_probs, dim=0) - top_probs
    kept = int((mass_before < top_p).sum())  # a prefix: the mass only grows
    choice = torch.multinomial(top_probs[:kept], 1, replacement=True, generator=generator)
    return int(top_ids[choice])


def sample_token(scores: Tensor, history: Sequence[int], options: SamplingOptions, generator: torch.Generator) -> int:
    """One token from log-softmax scores [V] (masked entries -inf) given the tokens decoded so far.

    Repetition-aware sampling: a nucleus draw; if that token already fills at least win_size * tau_r of the
    last win_size tokens, it is excluded (score -inf) and the token is drawn again from the whole remaining
    distribution, as the official `ras_sampling` does.
    """
    if options.greedy:
        return int(scores.argmax())
    scores = scores.float()
    token = nucleus_sample(torch.softmax(scores, dim=0), options.top_p, options.top_k, generator)
    repeats = sum(1 for previous in history[-options.win_size :] if previous == token)
    if repeats >= options.win_size * options.tau_r:
        excluded = scores.clone()
        excluded[token] = float("-inf")
        if not torch.isfinite(excluded).any():  # nothing else left to draw (the official code fails here)
            return token
        token = int(torch.multinomial(torch.softmax(excluded, dim=0), 1, replacement=True, generator=generator))
    return token


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
