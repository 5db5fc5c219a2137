"""What a decoder loop holds: each submitted request (`Ticket`), its sentences (`Sentence`) and the loop's counters
(`SchedulerStats`). The loop's parts (`engine.runtime.scheduler` and the modules it is made of) share these."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.errors import CosyVoiceError
from engine.llm.bistream import BistreamDecoder
from engine.llm.generation import TokenEvent
from engine.runtime.bistream import BistreamStart
from engine.runtime.playback import PlaybackClock
from engine.runtime.segment import EncodedSegment

Output = np.ndarray | CosyVoiceError | None
Sink = Callable[[Output], None]


@dataclass(eq=False)
class Sentence:
    """One sentence of a request, from its submission until its last audio is handed on."""

    segment: EncodedSegment
    request: Ticket
    memory_bytes: int
    llm_id: int | None = None  # its row in the generator while it generates tokens
    stream: Any = None  # streaming sentences: their engine.runtime.streaming stream
    tokens: list[int] = field(default_factory=list)  # whole sentences: the tokens so far
    events: list[TokenEvent] = field(default_factory=list)  # streaming sentences: not yet recorded in the stream
    recorded_at: int = 0  # streaming sentences: the LLM step count when a job last took in their tokens
    in_job: bool = False  # a flow + vocoder job works on it
    paused: bool = False  # out of the LLM batch until resumed (preempted by an earlier deadline)
    held: bool = False  # out of the LLM batch while a stream's first audio is made; it keeps its slot and KV cache
    cache_kept: bool = False  # paused with its KV cache set aside (it still holds its memory)
    tokens_done: bool = False
    done: bool = False
    outputs: list[np.ndarray] = field(default_factory=list)  # made, not yet handed on (an earlier one still runs)
    # a bi-streamed utterance: its start, then its LM (from admission), and the text pieces it has not taken yet
    # (None: the text ended)
    bistream_start: BistreamStart | None = None
    bistream: BistreamDecoder | None = None
    text_pieces: deque[list[int] | None] = field(default_factory=deque)


@dataclass(eq=False)
class Ticket:
    """One submitted request. `cancel` it (from any thread) when its caller leaves."""

    sentences: list[Sentence]
    streaming: bool
    sink: Sink
    playback: PlaybackClock  # its arrival, the audio handed on and its listener's slack
    expires_at: float  # the scheduler's clock past which it ends with DecodeLimitError
    cancelled: bool = False
    ended: bool = False
    emitted: int = 0  # sentences fully handed to the sink
    admitted: int = 0  # sentences admitted so far
    audio_started: bool = False  # some audio of it was made: its first-chunk priority is over
    speech_tokens: int = 0  # generated so far, over all its sentences
    complete: bool = True  # all its sentences are here: once they are handed on, it ends


@dataclass
class SchedulerStats:
    llm_steps: int = 0
    llm_batch_size_counts: Counter[int] = field(default_factory=Counter)
    joined_running_batch: int = 0  # sentences admitted while other sentences were generating
    mixed_steps: int = 0  # LLM steps shared by whole and streaming sentences
    pipelined_sentences: int = 0  # sentences admitted while the one before them in their request was vocoded
    vocode_batch_size_counts: Counter[int] = field(default_factory=Counter)
    # bi-streamed utterances' LM steps by how many utterances each ran (their forwards are one batch)
    bistream_batch_size_counts: Counter[int] = field(default_factory=Counter)
    llm_steps_while_vocoding: int = 0  # LLM steps that ran while a flow + vocoder job was running
    first_lane_chunks: int = 0  # first chunks made on the first-audio lane
    admitted: int = 0
    cancelled: int = 0
    request_faults: int = 0  # requests ended by a fault of their own (RequestFailedError) while the loop went on
    preempted: int = 0  # generating sentences paused to give their slot to an earlier deadline
    held_for_first_audio: int = 0  # generating sentences that sat out LLM steps while a stream's first audio was made
    resumed: int = 0
    over_limit: int = 0  # requests ended at their audio or time ceiling
    out_of_memory: int = 0  # LLM steps and flow + vocoder runs that ran out of device memory and were put back
    oom_paused: int = 0  # generating sentences paused to fit a live limit lowered by an out-of-memory
    oom_ended: int = 0  # requests ended because a sentence of theirs ran out of memory even alone
    oom_live_limit: int | None = None  # the live limit while an out-of-memory holds it below max_live, else None


def awaits_first_audio(sentences: list[Sentence]) -> bool:
    """Whether one of `sentences` streams a request that has no audio yet and is under way: not paused (a paused one
    waits for a slot, which the work held for it may be holding)."""
    return any(s.stream is not None and not s.paused and not s.request.audio_started for s in sentences)
