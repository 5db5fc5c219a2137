"""A decoder's cache of prepared voice prompts: what the decoder computes from a voice's prompt alone, kept per voice.

A request in a registered voice brings the same prompt every time (its transcript, speaker embedding, prompt speech
tokens and mel). The decoder prepares it once (`PreparedPrompt`): the LLM's KV cache over the rows of its input that
the prompt alone fixes (`engine.llm.generation.PromptPrefix`; which rows those are is the LM's `prompt_prefix_rows`),
and the prompt tensors the LLM and the flow read, on the device. Entries are keyed by the voice's name and
`EncodedSegment.prompt_key`, a hash of the prompt the encoder built: a voice registered again under the same name with
another recording, or used with another instruction, has another key and never gets a stale entry.

The cache is an LRU bounded in bytes (device memory when the decoder is on a GPU). The scheduler counts its bytes
against the replica's memory budget and empties it, oldest first, when a live sentence needs the room.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor

from engine.llm.generation import PromptPrefix

DEFAULT_PROMPT_CACHE_SHARE = 0.1  # of the replica's memory budget
DEFAULT_PROMPT_CACHE_BYTES = 256 * 2**20  # when the replica has no budget


def prompt_cache_bound(budget_bytes: int | None, share: float) -> int:
    """The cache's bound: `share` of the memory budget, or `DEFAULT_PROMPT_CACHE_BYTES` without a budget; 0 (off) for
    a share of 0."""
    if not 0 <= share < 1:
        raise ValueError(f"the prompt cache's share of the memory budget must be in [0, 1), got {share}")
    if not share:
        return 0
    return DEFAULT_PROMPT_CACHE_BYTES if budget_bytes is None else int(budget_bytes * share)


@dataclass(frozen=True)
class PreparedPrompt:
    """One voice prompt, prepared on the decoder's device."""

    prefix: PromptPrefix | None  # None: the LM input has no prompt-only rows worth keeping
    llm_prompt_speech_tokens: Tensor  # [P]
    llm_embedding: Tensor | None  # [spk_embed_dim]
    flow_prompt_speech_tokens: Tensor  # [P']
    prompt_feat: Tensor  # [Tp, mel_bins]
    flow_embedding: Tensor  # [spk_embed_dim]

    @property
    def nbytes(self) -> int:
        tensors = (
            self.llm_prompt_speech_tokens,
            self.llm_embedding,
            self.flow_prompt_speech_tokens,
            self.prompt_feat,
            self.flow_embedding,
        )
        held = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return held + (0 if self.prefix is None else self.prefix.nbytes)


PromptKey = tuple[str, str]  # (voice name, prompt key)


@dataclass
class PromptCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # entries dropped to stay within the bound or to make room for live sentences


class PromptCache:
    """An LRU of `PreparedPrompt`s holding at most `max_bytes` (0 turns it off). Thread-safe: the loop thread fills
    it, the vocoding lanes read it."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the prompt cache bound must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.stats = PromptCacheStats()
        self._entries: OrderedDict[PromptKey, PreparedPrompt] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: PromptKey) -> bool:
        return key in self._entries

    def get(self, key: PromptKey, count: bool = True) -> PreparedPrompt | None:
        """The entry (now the most recently used), or None; `count`: a hit or a miss in the stats."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            if count:
                if entry is None:
                    self.stats.misses += 1
                else:
                    self.stats.hits += 1
            return entry

    def put(self, key: PromptKey, entry: PreparedPrompt) -> bool:
        """Keep `entry`, dropping the least recently used ones to stay within the bound; -> whether it is kept (not
        when it alone is larger than the bound)."""
        size = entry.nbytes
        with self._lock:
            self._pop(key)
            if size > self.max_bytes:
                return False
            self._evict_to(self.max_bytes - size)
            self._entries[key] = entry
            self._bytes += size
            return True

    def resize(self, max_bytes: int) -> None:
        """A new bound (the replica's budget changed); entries past it are dropped, oldest first."""
        if max_bytes < 0:
            raise ValueError(f"the prompt cache bound must be >= 0 bytes, got {max_bytes}")
        with self._lock:
            self.max_bytes = max_bytes
            self._evict_to(max_bytes)

    def evict_to(self, max_bytes: int) -> int:
        """Drop the least recently used entries until at most `max_bytes` are held; -> bytes freed."""
        with self._lock:
            before = self._bytes
            self._evict_to(max_bytes)
            return before - self._bytes

    def forget_voice(self, voice: str) -> int:
        """Drop every entry of `voice` (it was deleted); -> entries dropped."""
        with self._lock:
            keys = [key for key in self._entries if key[0] == voice]
            for key in keys:
                self._pop(key)
            return len(keys)

    def _evict_to(self, max_bytes: int) -> None:
        while self._entries and self._bytes > max_bytes:
            _, entry = self._entries.popitem(last=False)
            self._bytes -= entry.nbytes
            self.stats.evictions += 1

    def _pop(self, key: PromptKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
