"""The decoder loop's limits on its live set, and their back-off after running out of device memory.

Running out of device memory (`torch.cuda.OutOfMemoryError`, raised by the allocator at the replica's share) is no
request's fault and ends none that can fit alone: the allocator's cache is emptied and the live limit (also the flow
+ vocoder batch cap) is halved for `backoff_s`, then doubled back each such while without another. Work that runs out
with one sentence alone in it is run again at once on the loop thread with nothing beside it; if that runs out too,
its request ends with `UnavailableError` (503) naming the replica's memory limit (docs/reliability.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from engine.errors import RequestTooLargeError, UnavailableError
from engine.loading.loader import LoadedModel
from engine.runtime.bistream import BistreamStart
from engine.runtime.loop_state import Sentence
from engine.runtime.memory import PLANNED_SPEECH_S, describe_memory_limit, estimate_request_memory, segment_memory
from engine.runtime.request_set import RequestSet
from engine.runtime.segment import EncodedSegment

logger = logging.getLogger(__name__)

OOM_BACKOFF_S = 30.0  # how long a live limit lowered by an out-of-memory holds before it is doubled back


class LiveLimits:
    """`max_live` generating sentences within `memory_budget_bytes` (None: no budget), each counted by its estimate
    (`engine.runtime.memory`); after an out-of-memory the live limit is lowered for a while (`live_limit`)."""

    def __init__(
        self,
        max_live: int,
        memory_budget_bytes: int | None,
        model: LoadedModel,
        requests: RequestSet,
        on_out_of_memory: Callable[[int], None] | None = None,
        backoff_s: float = OOM_BACKOFF_S,
    ) -> None:
        self.max_live, self.memory_budget_bytes, self.model = max_live, memory_budget_bytes, model
        self.requests, self.lanes, self.stats, self.clock = requests, requests.lanes, requests.stats, requests.clock
        self.on_out_of_memory = on_out_of_memory
        self.backoff_s = backoff_s
        self._lowered: int | None = None  # the live limit an out-of-memory set, until `_lowered_until`
        self._lowered_until = 0.0

    @property
    def live_limit(self) -> int:
        """The live sentences admitted now: `max_live`, lower for a while after running out of device memory."""
        return self.max_live if self._lowered is None else min(self.max_live, self._lowered)

    def memory_estimate(self, segment: EncodedSegment) -> int:
        """Bytes one sentence holds while it is live: its KV cache at its longest, flow and vocoder activations."""
        return segment_memory(self.model.config, segment, self.model.dtype.itemsize).total_bytes

    def check_fits(self, segments: list[EncodedSegment]) -> list[int]:
        """Each sentence's memory estimate; `RequestTooLargeError` when one alone exceeds the whole budget."""
        estimates = [self.memory_estimate(segment) for segment in segments]
        budget = self.memory_budget_bytes
        if budget is not None and max(estimates, default=0) > budget:
            raise RequestTooLargeError(
                f"a sentence of this request needs about {max(estimates) / 2**20:.0f} MiB of decoder memory; the "
                f"replica's whole budget is {budget / 2**20:.0f} MiB: send shorter sentences or a lower "
                "max_token_text_ratio"
            )
        return estimates

    def bistream_estimate(self, start: BistreamStart) -> int:
        """A bi-streamed utterance's estimate: its text is unknown when it starts, so it counts as the sentence a
        replica is planned for (`PLANNED_SPEECH_S` of speech). Counting it to the audio ceiling (600 s by default)
        made one utterance fill a CPU replica's budget, so that text streams ran one at a time."""
        config, voice = self.model.config, start.voice
        ratio = voice.sampling.max_token_text_ratio
        return estimate_request_memory(
            config,
            math.ceil(config.speech_tokens_for(PLANNED_SPEECH_S) / ratio),
            prompt_text_tokens=len(start.prompt_text_tokens),
            prompt_speech_tokens=len(voice.llm_prompt_speech_tokens),
            max_token_text_ratio=ratio,
            dtype_bytes=self.model.dtype.itemsize,
        ).total_bytes

    def free_cached_memory(self) -> None:
        """Count an out-of-memory and hand the allocator's cached blocks back, so the retry finds them free."""
        self.stats.out_of_memory += 1
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def lower(self, where: str) -> None:
        """After an out-of-memory: halve the live limit (at least 1) for `backoff_s`."""
        self.free_cached_memory()
        self._lowered = max(1, min(self.live_limit, self.requests.generating_slots) // 2)
        self._lowered_until = self.clock() + self.backoff_s
        self.stats.oom_live_limit = self.live_limit
        logger.warning(
            "the decoder ran out of device memory in %s; it retries with at most %d live sentences for %g s",
            where,
            self.live_limit,
            self.backoff_s,
        )
        if self.on_out_of_memory is not None:
            self.on_out_of_memory(self.live_limit)

    def relax(self) -> None:
        """Double a live limit lowered by an out-of-memory back, each `backoff_s` without another one."""
        if self._lowered is None or self.clock() < self._lowered_until:
            return
        self._lowered *= 2
        self._lowered_until = self.clock() + self.backoff_s
        if self._lowered >= self.max_live:
            self._lowered = None
        self.stats.oom_live_limit = None if self._lowered is None else self.live_limit
        logger.info("the decoder's live limit is back up to %d", self.live_limit)

    def run_alone(self, sentence: Sentence, where: str, work: Callable[[], Any]) -> Any:
        """`sentence`'s work ran out of device memory with it alone in its LLM step or flow + vocoder run, and was
        put back: lower the live limit, wait for the running jobs, and run `work` again at once on this thread, with
        nothing else decoding -> its result. If it runs out again the sentence cannot fit even alone: its request
        ends with a 503 naming the replica's memory limit (-> None)."""
        self.lower(where)
        self.lanes.wait_all()
        try:
            return work()
        except torch.cuda.OutOfMemoryError:
            self.free_cached_memory()
        self.stats.oom_ended += 1
        limit = describe_memory_limit(self.model.decoder_device, self.memory_budget_bytes)
        logger.warning("a sentence ran out of device memory in %s even alone (%s): its request ends", where, limit)
        self.requests.fail(
            sentence.request,
            UnavailableError(
                f"a sentence of this request needs more device memory than this decoder replica has, {limit}, even "
                "with nothing else decoding; send shorter sentences or a lower max_token_text_ratio, or retry on a "
                "replica with a larger GPU fraction"
            ),
        )
        return None
