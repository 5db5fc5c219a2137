"""Continuous batching over every request of a decoder: one loop, one model copy, one queue, three threads.

Callers `submit` a request (its sentences, whole or streaming) from any thread; a request submitted incomplete gets
its later sentences by `extend` as they are encoded (its first ones decode meanwhile), and ends only once they are all
there and done (while it waits for them it holds no slot) or with an error of theirs (`extend` refuses what `submit`
would; `abort`). The loop thread calls `step` again and again (`run` does it for ever); the flow + vocoder work runs
at the same time on two vocoding threads, the lanes. One `step`:

1. takes in the flow + vocoder jobs that finished (their audio goes to their sentences), the new
   submissions, drops the cancelled requests (their LLM rows and memory leave the live set here, before
   any compute), and hands on the audio made (so every playback clock, and so every deadline, is current before
   anything is chosen);
2. runs one LLM step for every sentence that is generating tokens; the ones admitted at the previous step
   are prefilled in it and join the running batch (on CPU, while a stream generates toward its first audio, the
   sentences the policy may hold sit this step out: `hold_rows`);
3. admits sentences in the policy's order (`engine.runtime.playback`) while the live set stays within `max_live`
   generating sentences and the memory budget, each sentence counted by its own estimate (`engine.runtime.memory`).
   A request's next sentence may join as soon as the sentence before it has all its tokens, before that one's
   last audio is made (so the next sentence's tokens are generated while the current one is vocoded, with no
   round trip through the caller). The default `DeadlinePolicy` admits earliest playback deadline first and, when
   the earliest waiting sentence has no slot, pauses a generating sentence whose request has slack to spare (its
   KV cache set aside, or dropped and recomputed when memory is short) and resumes it when it is again the
   earliest; `FcfsPolicy` admits a running request's next sentence first, then the oldest new request;
4. hands each free lane one job, a flow + vocoder batch of at most `max_vocode_batch` sentences:
   - the first-audio lane takes the streams of requests that have no audio yet, in the policy's order for them
     (`first_audio_key`: the shortest first chunk first until one has been passed over too long; fcfs: oldest first);
   - the main lane takes such streams too (in that order) if one of them is due first, else the ready work earliest
     deadline first, leaving for later the work the policy holds while a stream waits for its first audio (fcfs: streams
     whose audio has started, those waiting longest first, and whole sentences whose tokens are all there, the two
     kinds in turns).
   A job takes in the stream tokens that waited in the loop thread and emits the chunks they complete.

So neither side waits for the other: the LLM steps on while flow + vocoder batches run, and a batch that is
ready starts as soon as its lane is free. A new request's first chunk does not wait behind a running batch
(its lane is free unless another first chunk is being made). The lanes never work on the same stream; the
loop thread only adds streams (a new stream has no tokens for a running emit), stops them, and releases one
once no job works on it. The threads share the device: on CPU, its cores (the loop thread keeps half the
torch threads, each lane the other half, at least one each); on CUDA, each lane has a CUDA stream of its own (a stream
state that moves from one lane to the other goes through `engine.runtime.handoff`).
A step with nothing to generate waits for a job or a new request instead of spinning.
Outputs go to each request's `sink`, in sentence order: audio arrays (a streaming request's chunks, a
whole request's sentences), then None at the end, or a `CosyVoiceError` that ends the request.

The loop serves many requests at once, so a fault is the failing request's alone wherever one request explains it:
a segment is checked when it is submitted (`SpeechDecoderStage.check_segment`); a sentence whose admission raises,
whose prefill or sampling raises (`TokenGenerator.step`), or whose flow + vocoder work raises alone (a job that
raises is run again sentence by sentence, `engine.errors.isolate_failures`) ends its request with that error, and
the others go on with the audio they would have had without it. Every request also ends at its ceilings: at most
`max_audio_s` of speech and `max_request_s` of wall time from its submission (`DecodeLimitError`).

Running out of device memory (`torch.cuda.OutOfMemoryError`, raised by the allocator at the replica's share) is no
request's fault and ends none that can fit alone. The allocator's cache is emptied and the live limit (`live_limit`,
also the flow + vocoder batch cap) is halved for `oom_backoff_s` (then doubled back each such while without another).
An LLM step that runs out is undone (`TokenGenerator.step`); the newest generating sentences past the lowered limit
are paused (their KV caches dropped, recomputed on resume) and the step runs again at the next `step`. A flow +
vocoder job that runs out is run again sentence by sentence (streams put back to their state before it). Work that
runs out with one sentence alone in it is run again at once on the loop thread with nothing beside it (the running
jobs waited for); if that runs out too, the sentence cannot fit even alone: its request ends with `UnavailableError`
(503) naming the replica's memory limit, the others go on. Nothing handed on is made twice, and every sampler keeps
its place.

A step that raises beyond that (a fault no single request explains) ends the loop: every request gets the error, later
submissions are refused with `UnavailableError`, and `failure` tells the replica to have itself replaced.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import numpy as np
import torch

from engine.errors import (
    CosyVoiceError,
    DecodeLimitError,
    InvalidInputError,
    RequestFailedError,
    RequestTooLargeError,
    UnavailableError,
    as_request_error,
    isolate_failures,
)
from engine.llm.generation import GenerationRequest, TokenEvent, TokenGenerator
from engine.runtime.handoff import hand_over, loop_stream, on_stream, take_over
from engine.runtime.memory import describe_memory_limit, is_out_of_memory, segment_memory
from engine.runtime.pipeline import SpeechDecoderStage
from engine.runtime.playback import SECONDS_PER_TEXT_TOKEN, DeadlinePolicy, PlaybackClock, SchedulingPolicy
from engine.runtime.prompt_cache import DEFAULT_PROMPT_CACHE_SHARE, PromptCache, prompt_cache_bound
from engine.runtime.segment import EncodedSegment
from engine.runtime.streaming import DecodeStream

logger = logging.getLogger(__name__)

DEFAULT_VOCODE_BATCH_CUDA, DEFAULT_VOCODE_BATCH_CPU = 8, 1
OOM_BACKOFF_S = 30.0  # how long a live limit lowered by an out-of-memory holds before it is doubled back
FIRST, MAIN = "first", "main"  # the lanes
Output = np.ndarray | CosyVoiceError | None
Sink = Callable[[Output], None]


class _SharedGenerator:
    """The loop's token generator, locked: a lane may stop a stream (a non-finite chunk) while
    the loop thread steps the generator. Every call runs its kernels on the loop thread's CUDA stream, whichever
    thread makes it, so a lane that drops a generator row slices the KV cache in order with the LLM steps
    (engine.runtime.handoff)."""

    def __init__(self, generator: TokenGenerator, device: torch.device) -> None:
        self.generator = generator
        self.model = generator.model
        self._lock = threading.Lock()
        self._stream = loop_stream(device)

    @property
    def active(self) -> int:
        return self.generator.active

    @property
    def batch_size(self) -> int:
        return self.generator.batch_size

    def on_loop_stream(self) -> AbstractContextManager:
        """Run the caller's kernels on the loop's CUDA stream, in order with the LLM's steps."""
        return on_stream(self._stream)

    def add(self, request: GenerationRequest) -> int:
        with self._lock, on_stream(self._stream):
            return self.generator.add(request)

    def cancel(self, request_id: int) -> bool:
        with self._lock, on_stream(self._stream):
            return self.generator.cancel(request_id)

    def pause(self, request_ids: list[int], keep_cache: bool) -> None:
        with self._lock, on_stream(self._stream):
            self.generator.pause(request_ids, keep_cache)

    def resume(self, request_ids: list[int]) -> None:
        with self._lock, on_stream(self._stream):
            self.generator.resume(request_ids)

    def step(self) -> list[TokenEvent]:
        with self._lock, on_stream(self._stream):
            return self.generator.step()


@dataclass(eq=False)
class _Sentence:
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


@dataclass(eq=False)
class Ticket:
    """One submitted request. `cancel` it (from any thread) when its caller leaves."""

    sentences: list[_Sentence]
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
class _Late:
    """What an incomplete request got after its submission: more sentences (the last ones if `final`), or the error
    that ends it."""

    ticket: Ticket
    sentences: list[_Sentence] = field(default_factory=list)
    final: bool = False
    error: CosyVoiceError | None = None


@dataclass
class _Job:
    """The flow + vocoder work running on a lane."""

    kind: Literal["streams", "whole"]
    future: Future[Any]
    sentences: list[_Sentence]  # the sentences it works on
    to_release: list[Any] = field(default_factory=list)  # streams of cancelled sentences, released once it is over


@dataclass
class SchedulerStats:
    llm_steps: int = 0
    llm_batch_size_counts: Counter[int] = field(default_factory=Counter)
    joined_running_batch: int = 0  # sentences admitted while other sentences were generating
    mixed_steps: int = 0  # LLM steps shared by whole and streaming sentences
    pipelined_sentences: int = 0  # sentences admitted while the one before them in their request was vocoded
    vocode_batch_size_counts: Counter[int] = field(default_factory=Counter)
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


class Scheduler:
    """The continuous-batching loop of one decoder (see the module docstring). One thread runs `step` (or
    `run`); `submit` and `cancel` may come from any other."""

    def __init__(
        self,
        stage: SpeechDecoderStage,
        max_live: int,
        memory_budget_bytes: int | None = None,
        max_vocode_batch: int | None = None,
        max_audio_s: float | None = None,
        max_request_s: float | None = None,
        policy: SchedulingPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_request_end: Callable[[Ticket, CosyVoiceError | None], None] | None = None,
        on_out_of_memory: Callable[[int], None] | None = None,
        oom_backoff_s: float = OOM_BACKOFF_S,
        prompt_cache_bytes: int | None = None,
        hold_rows: bool | None = None,
    ) -> None:
        """`on_request_end(ticket, error)` is called on the loop thread when a request ends (its `playback` says
        when its audio came and how its listener fared); `on_out_of_memory(live_limit)` when the loop ran out of
        device memory and lowered its live limit to `live_limit`. `prompt_cache_bytes` bounds the cache of prepared
        voice prompts (`engine.runtime.prompt_cache`; 0 turns it off); None: `DEFAULT_PROMPT_CACHE_SHARE` of the
        memory budget (`prompt_cache_bound`). Its bytes count against the budget: a sentence
        that needs them empties it, oldest entries first. `hold_rows`: whether the generating sentences the policy may
        hold sit out of the LLM steps while a stream generates toward its first audio; None: on CPU only."""
        self.stage = stage
        self.policy: SchedulingPolicy = policy or DeadlinePolicy()
        self.clock = clock
        self.on_request_end = on_request_end
        self.on_out_of_memory = on_out_of_memory
        self.max_live = max_live
        self.oom_backoff_s = oom_backoff_s
        self._oom_limit: int | None = None  # the live limit an out-of-memory set, until `_oom_until`
        self._oom_until = 0.0
        self.memory_budget_bytes = memory_budget_bytes
        self.max_audio_s = max_audio_s
        self.max_speech_tokens = None if max_audio_s is None else stage.model.config.speech_tokens_for(max_audio_s)
        self.max_request_s = max_request_s
        self.failure: Exception | None = None  # what ended the loop: the replica should be replaced
        # On CPU the flow and vocoder run ~1.2x faster at batch 8 than 1 (docs/performance.md): small jobs cost little
        # and let a first chunk wait less; on a GPU batching pays and a job takes milliseconds.
        cuda = stage.model.decoder_device.type == "cuda"
        # On CPU an LLM step grows with its rows (tiny v1: 0.8 ms at 1 row, 2.3 ms at 8), so the rows the
        # policy may hold sit out while a stream generates toward its first audio; on a GPU a decode step is bound by
        # reading the weights, much the same at 1 or 8 rows (not measured: no GPU yet), so setting KV caches aside
        # would only cost copies.
        self.hold_rows = stage.model.decoder_device.type == "cpu" if hold_rows is None else hold_rows
        self.max_vocode_batch = max_vocode_batch or (DEFAULT_VOCODE_BATCH_CUDA if cuda else DEFAULT_VOCODE_BATCH_CPU)
        if prompt_cache_bytes is None:
            prompt_cache_bytes = prompt_cache_bound(memory_budget_bytes, DEFAULT_PROMPT_CACHE_SHARE)
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        stage.prompt_cache = self.prompt_cache  # the stage prepares the prompts: the loop owns their memory
        self.llm = _SharedGenerator(TokenGenerator(stage.model.llm), stage.model.decoder_device)
        self.streams = DecodeStream(stage, [], llm=self.llm)
        self._first_chunk_s = _first_chunk_s(self.streams)
        self.stats = SchedulerStats()
        self._inbox: list[Ticket] = []
        self._late: list[_Late] = []  # for incomplete requests, taken in with the inbox
        self._incomplete: set[Ticket] = set()  # requests whose later sentences may still come
        self._lock = threading.Lock()
        self._wakeup = threading.Event()  # set by submit, cancel and a finished job
        self._queue: deque[Ticket] = deque()  # requests with sentences still to admit, in arrival order
        self._live: list[_Sentence] = []
        self._by_llm_id: dict[int, _Sentence] = {}
        self._jobs: dict[str, _Job] = {}  # by lane, while running
        self._main_turn: Literal["streams", "whole"] = "streams"
        # On CPU the loop thread and the lanes split the torch threads (at least one each); on CUDA each lane
        # works on its own CUDA stream, so its kernels overlap the LLM's and the other lane's.
        threads = torch.get_num_threads()
        self._loop_threads = max(1, threads - threads // 2)
        self._lanes = {
            lane: ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"vocoder-{lane}", initializer=self._init_lane, initargs=(threads,)
            )
            for lane in (FIRST, MAIN)
        }

    def _init_lane(self, threads: int) -> None:
        torch.set_num_threads(max(1, threads // 2))  # per thread: the loop thread keeps its own count
        device = self.stage.model.decoder_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the weights' copies are done before another stream reads them
            torch.cuda.set_stream(torch.cuda.Stream(device))  # current for this thread only

    # --- any thread ------------------------------------------------------------------------------------

    def memory_estimate(self, segment: EncodedSegment) -> int:
        """Bytes one sentence holds while it is live: its KV cache at its longest, flow and vocoder activations."""
        model = self.stage.model
        return segment_memory(model.config, segment, model.dtype.itemsize).total_bytes

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

    def submit(self, segments: list[EncodedSegment], streaming: bool, sink: Sink, complete: bool = True) -> Ticket:
        """Queue a request (refused at once if its segments are not what this decoder takes, if it can never fit,
        or cannot stream, or the loop has failed); it is admitted at a coming `step`. Not `complete`: its later
        sentences come by `extend`."""
        if not isinstance(segments, list) or not segments:
            raise InvalidInputError("a request needs a list of at least one segment")
        now = self.clock()
        playback = PlaybackClock(
            now,
            sum(s.text_len for s in segments) * SECONDS_PER_TEXT_TOKEN,
            first_chunk_s=min(segments[0].text_len * SECONDS_PER_TEXT_TOKEN, self._first_chunk_s),
        )
        expires_at = now + (self.max_request_s if self.max_request_s is not None else float("inf"))
        ticket = Ticket(
            sentences=[], streaming=streaming, sink=sink, playback=playback, expires_at=expires_at, complete=complete
        )
        ticket.sentences = self._checked_sentences(ticket, segments)
        with self._lock:
            self._check_running()
            self._inbox.append(ticket)
        self._wakeup.set()
        return ticket

    def extend(self, ticket: Ticket, segments: list[EncodedSegment], final: bool) -> None:
        """Queue the next sentences of a request submitted incomplete, after those it has (the last ones if `final`).
        Refused, the request unchanged, as `submit` refuses (the caller then ends it: `abort`)."""
        if not isinstance(segments, list):
            raise InvalidInputError("later sentences come as a list of segments")
        sentences = self._checked_sentences(ticket, segments)
        with self._lock:
            self._check_running()
            self._late.append(_Late(ticket, sentences, final))
        self._wakeup.set()

    def abort(self, ticket: Ticket, error: CosyVoiceError) -> None:
        """End a request with `error` at the next `step` (its later sentences cannot come: their encoding failed, or
        one was refused)."""
        with self._lock:
            if self.failure is None:  # else the failure ended it
                self._late.append(_Late(ticket, error=error))
        self._wakeup.set()

    def _checked_sentences(self, ticket: Ticket, segments: list[EncodedSegment]) -> list[_Sentence]:
        for segment in segments:  # here, not at admission: work refused inside `step` costs the loop a step
            self.stage.check_segment(segment)
            if ticket.streaming:
                self.streams.check_streamable(segment)
        estimates = self.check_fits(segments)
        return [_Sentence(s, ticket, bytes_) for s, bytes_ in zip(segments, estimates, strict=True)]

    def _check_running(self) -> None:
        if self.failure is not None:
            raise UnavailableError("this decoder replica's loop failed and the replica is being replaced; retry")

    def cancel(self, ticket: Ticket) -> None:
        """The caller left: the request's sentences leave the live set at the next `step`."""
        ticket.cancelled = True
        self._wakeup.set()

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def queued(self) -> int:
        return sum(len(t.sentences) - t.admitted for t in tuple(self._queue))

    @property
    def live_bytes(self) -> int:
        """Memory the live sentences hold (a sentence paused without its KV cache holds none)."""
        return sum(s.memory_bytes for s in tuple(self._live) if not s.paused or s.cache_kept)

    @property
    def live_limit(self) -> int:
        """The live sentences admitted now: `max_live`, lower for a while after running out of device memory. It
        caps flow + vocoder batches too."""
        return self.max_live if self._oom_limit is None else min(self.max_live, self._oom_limit)

    @property
    def vocode_batch(self) -> int:
        return min(self.max_vocode_batch, self.live_limit)

    @property
    def generating_slots(self) -> int:
        """Live sentences that count against `max_live`: all but the paused ones."""
        return sum(not s.paused for s in tuple(self._live))

    @property
    def awaiting_sentences(self) -> int:
        """Requests whose later sentences may still come."""
        return len(self._incomplete)

    @property
    def has_work(self) -> bool:
        return bool(self._live or self._queue or self._inbox or self._late or self._jobs) or self._incomplete_due()

    def _incomplete_due(self) -> bool:
        """A request waiting for its later sentences must end now: cancelled, or past its time ceiling."""
        now = self.clock()
        return any(t.cancelled or now > t.expires_at for t in tuple(self._incomplete))

    def _until_incomplete_expires(self) -> float | None:
        """Seconds until the first time ceiling of a request waiting for its later sentences; None: no such one."""
        expires_at = min((t.expires_at for t in tuple(self._incomplete)), default=math.inf)
        return None if math.isinf(expires_at) else max(0.0, expires_at - self.clock())

    # --- the loop thread ---------------------------------------------------------------------------------

    def run(self, on_busy: Callable[[bool], None], on_error: Callable[[Exception], CosyVoiceError]) -> None:
        """Run the loop in the calling thread until it fails: steps while there is work, asleep otherwise.

        `on_busy(True)` when work arrives at an idle loop, `on_busy(False)` when the loop runs out of it. A step
        that raises (a fault no single request explains: a request's own end that request alone) ends every request
        with `on_error(exc)` and the loop (`fail`)."""
        torch.set_num_threads(self._loop_threads)
        busy = False
        while self.failure is None:
            self._wakeup.clear()
            if not self.has_work:
                if busy:
                    on_busy(busy := False)
                self._wakeup.wait(self._until_incomplete_expires())
                continue
            if not busy:
                on_busy(busy := True)
            try:
                self.step()
            except Exception as exc:
                self.fail(exc, on_error(exc))

    @torch.inference_mode()
    def step(self) -> None:
        """One round of the loop: take in, one LLM step, admit, then start the flow + vocoder jobs that are due."""
        self._wait_if_only_vocoding()
        self._relax_live_limit()
        self._finish_jobs()
        self._take_inbox()
        self._drop_cancelled()
        self._end_overdue()
        # the audio made is handed on before anything is chosen: a request's deadline moves with its playback clock
        for ticket in {sentence.request for sentence in self._live}:
            self._flush(ticket)
        if self.llm.active:
            self._llm_step()
        self._admit()  # after the step: a sentence whose last token just came hands its slot on before vocoding
        self._start_jobs()
        self._hold_rows_for_first_audio()  # here: a loop about to wait for a job knows which rows generate
        self._live = [s for s in self._live if not s.done]

    def fail(self, cause: Exception, error: CosyVoiceError) -> None:
        """A step failed half-way, with a fault no single request explains: the loop's state is suspect, so every
        request ends with `error`, later submissions are refused, and `failure` is `cause`."""
        with self._lock:
            self.failure = cause
        self._take_inbox()
        for ticket in {s.request for s in self._live} | set(self._queue) | self._incomplete:
            self._end(ticket, error)
        self._live, self._queue, self._by_llm_id, self._incomplete = [], deque(), {}, set()
        self._jobs = {}  # a running job's results are dropped

    def _wait_if_only_vocoding(self) -> None:
        """With nothing to generate or admit, wait for a running job (or a new request, or a cancel): the last step
        started every job that could start."""
        self._wakeup.clear()  # what sets it after this line is seen by the wait; what set it before, by the checks
        if not self._jobs or any(job.future.done() for job in self._jobs.values()):
            return
        if self.llm.active or self._inbox or self._late or self._admissible():
            return
        if any(s.request.cancelled for s in self._live) or self._incomplete_due():
            return
        self._wakeup.wait()

    def _take_inbox(self) -> None:
        with self._lock:  # one take: a request's later sentences never come in before it
            arrived, self._inbox = self._inbox, []
            late, self._late = self._late, []
        self._queue.extend(arrived)
        self._incomplete.update(t for t in arrived if not t.complete)
        for item in late:
            self._take_late(item)

    def _take_late(self, late: _Late) -> None:
        ticket = late.ticket
        if ticket.ended:  # cancelled or failed meanwhile
            return
        if late.error is not None:
            self._fail_request(ticket, late.error)
            self._live = [s for s in self._live if s.request is not ticket]
            return
        ticket.sentences += late.sentences
        ticket.playback.estimated_audio_s += sum(s.segment.text_len for s in late.sentences) * SECONDS_PER_TEXT_TOKEN
        if late.final:
            ticket.complete = True
            self._incomplete.discard(ticket)
        if ticket.admitted < len(ticket.sentences) and ticket not in self._queue:
            self._queue.append(ticket)
        self._flush(ticket)  # ends a request whose every sentence was handed on before its last word came

    def _drop_cancelled(self) -> None:
        cancelled = {s.request for s in self._live if s.request.cancelled} | {
            t for t in (*self._queue, *self._incomplete) if t.cancelled
        }
        for ticket in cancelled:
            self._stop(ticket, None)
            self.stats.cancelled += 1
        self._live = [s for s in self._live if s.request not in cancelled]

    def _stop(self, ticket: Ticket, last: CosyVoiceError | None) -> None:
        """End a request early (cancelled, or `last` is its error): free its generator rows and stream state."""
        for sentence in ticket.sentences[ticket.emitted : ticket.admitted]:
            if sentence.stream is not None:
                self.streams.stop(sentence.stream)  # its generator row goes now
                self._release(sentence)
                sentence.stream = None
            elif sentence.llm_id is not None:
                self.llm.cancel(sentence.llm_id)
            if sentence.llm_id is not None:
                del self._by_llm_id[sentence.llm_id]
                sentence.llm_id = None
        for sentence in ticket.sentences:
            sentence.done = True
        if ticket in self._queue:
            self._queue.remove(ticket)
        self._end(ticket, last)

    def _release(self, sentence: _Sentence) -> None:
        """Forget its stream now, or when the job that works on it is over."""
        job = next((job for job in self._jobs.values() if sentence in job.sentences), None)
        if job is None:
            self.streams.release(sentence.stream)
        else:
            job.to_release.append(sentence.stream)

    def _candidates(self) -> list[_Sentence]:
        """The sentences that may join the LLM batch, in the policy's order: each queued request's next one (a
        running request's once the sentences before it have all their tokens) and the paused ones."""
        keyed = [
            (self.policy.admission_key(t, continues=bool(t.admitted)), t.sentences[t.admitted])
            for t in self._queue
            if all(s.tokens_done for s in t.sentences[: t.admitted])
        ]
        keyed += [(self.policy.admission_key(s.request, continues=True), s) for s in self._live if s.paused]
        return [sentence for _, sentence in sorted(keyed, key=lambda item: item[0])]

    def _fits(self, sentence: _Sentence) -> bool:
        """Whether `sentence` may join the batch now: a free slot, and room in the memory budget (an empty loop
        takes any sentence: `check_fits` refused those larger than the whole budget)."""
        if self.generating_slots >= self.live_limit:
            return False
        budget, held = self.memory_budget_bytes, self.live_bytes
        needed = 0 if sentence.cache_kept else sentence.memory_bytes
        if budget is None:
            return True
        self._trim_prompt_cache(held + needed)
        return not held or held + needed + self.prompt_cache.nbytes <= budget

    def _trim_prompt_cache(self, live_bytes: int) -> None:
        """Live sentences come first: the prompt cache gives up what they need of the memory budget."""
        budget = self.memory_budget_bytes
        if budget is not None and live_bytes + self.prompt_cache.nbytes > budget:
            self.prompt_cache.evict_to(max(0, budget - live_bytes))

    def _admissible(self) -> bool:
        candidates = self._candidates()
        return bool(candidates) and self._fits(candidates[0])

    def _admit(self) -> None:
        """Admit (or resume) sentences in the policy's order while they fit; the first that does not fit may take the
        slot of a generating sentence the policy lets it pause, and otherwise waits, with every one after it."""
        now = self.clock()
        for sentence in self._candidates():
            if not self._fits(sentence) and not self._preempt_for(sentence, now):
                return
            if sentence.paused:
                self.llm.resume([sentence.llm_id])
                sentence.paused = sentence.cache_kept = False
                self.stats.resumed += 1
            elif not self._start_generating(sentence):
                return

    def _preempt_for(self, waiting: _Sentence, now: float) -> bool:
        """Pause generating sentences, the latest deadline first, while the policy allows it and `waiting` does not
        fit; -> whether it fits now. A paused sentence keeps its KV cache unless memory is what `waiting` lacks."""
        while not self._fits(waiting):
            victims = [
                s
                for s in self._live
                if not (s.paused or s.tokens_done or s.llm_id is None)
                and s.request is not waiting.request
                and self.policy.may_preempt(s.request, waiting.request, now)
            ]
            if not victims:
                return False
            victim = max(victims, key=lambda s: self.policy.deadline(s.request))
            if victim.held:  # back into the batch first: it is paused the way its slot's new owner needs
                self.llm.resume([victim.llm_id])
                victim.held = False
            budget = self.memory_budget_bytes
            self._pause(victim, keep_cache=budget is None or self.live_bytes + waiting.memory_bytes <= budget)
            self.stats.preempted += 1
        return True

    def _pause(self, sentence: _Sentence, keep_cache: bool) -> None:
        """Take a generating sentence out of the LLM batch until it is admitted again; its KV cache is set aside if
        `keep_cache` and there is device memory for the copy, else recomputed on resume."""
        try:
            self.llm.pause([sentence.llm_id], keep_cache=keep_cache)
        except torch.cuda.OutOfMemoryError:  # the copy of its rows did not fit; nothing changed
            keep_cache = False
            self.llm.pause([sentence.llm_id], keep_cache=False)
        sentence.paused, sentence.cache_kept = True, keep_cache

    def _add_to_generator(self, sentence: _Sentence) -> bool:
        """Its generator row (and stream, when streaming), made from its segment -> True. On the LLM's CUDA stream:
        a voice's prompt prefix may be prefilled here."""
        with self.llm.on_loop_stream():
            return self._add_rows(sentence)

    def _add_rows(self, sentence: _Sentence) -> bool:
        if sentence.request.streaming:
            sentence.stream = self.streams.add(sentence.segment)
            sentence.llm_id = sentence.stream.llm_id
        else:
            [request] = self.stage.generation_requests([sentence.segment])
            sentence.llm_id = self.llm.add(request)
        return True

    def _start_generating(self, sentence: _Sentence) -> bool:
        """Admit a request's next sentence: its generator row (its stream, when streaming) starts in the next step.
        -> whether admission goes on (not after running out of device memory: the sentence waits, still queued)."""
        ticket = sentence.request
        try:
            self._add_to_generator(sentence)
        except torch.cuda.OutOfMemoryError:  # its inputs' copy to the device: nothing was added
            if self._live or self._jobs:  # others hold memory: it waits, still queued, until some is freed
                self._lower_live_limit("an admission")
                return False
            # nothing else holds any: it is tried once more, alone, and if it cannot fit its request ends
            if self._run_alone(sentence, "an admission", partial(self._add_to_generator, sentence)) is None:
                return True
        except Exception as exc:  # this request's input: it ends, the admission goes on
            self._fail_request(ticket, as_request_error(exc))
            return True
        if self.llm.batch_size:
            self.stats.joined_running_batch += 1
        if ticket.admitted and not ticket.sentences[ticket.admitted - 1].done:
            self.stats.pipelined_sentences += 1
        self._by_llm_id[sentence.llm_id] = sentence
        ticket.admitted += 1
        self.stats.admitted += 1
        self._live.append(sentence)
        self._trim_prompt_cache(self.live_bytes)  # its admission may have cached its voice's prompt
        if ticket.admitted == len(ticket.sentences):
            self._queue.remove(ticket)
        return True

    def _hold_rows_for_first_audio(self) -> None:
        """While a stream that has no audio yet generates, the generating sentences the policy may hold sit out of the
        LLM batch (`hold_rows`), their KV caches set aside; they rejoin once no such stream generates, or once their
        deadline comes near. Those that leave or rejoin at a step do so together: the batch's cache is copied once."""
        if not self.hold_rows:
            return
        generating = [s for s in self._live if not (s.tokens_done or s.paused or s.llm_id is None)]
        first_audio_due = _awaits_first_audio(generating)
        now = self.clock()
        hold = [s for s in generating if first_audio_due and self.policy.may_hold(s.request, now)]
        to_hold = [s for s in hold if not s.held]
        to_release = [s for s in generating if s.held and s not in hold]
        if to_hold:
            self.llm.pause([s.llm_id for s in to_hold], keep_cache=True)
            self.stats.held_for_first_audio += len(to_hold)
        if to_release:
            self.llm.resume([s.llm_id for s in to_release])
        for sentence in generating:
            sentence.held = sentence in hold

    def _llm_step(self) -> None:
        generating = [s for s in self._live if not (s.tokens_done or s.paused or s.held)]
        batch_size = self.llm.active
        while_vocoding = any(not job.future.done() for job in self._jobs.values())
        try:
            events = self.llm.step()
        except torch.cuda.OutOfMemoryError:  # the generator is as it was before the step
            retried = self._llm_out_of_memory(generating)
            if retried is None:
                return
            events = retried
        self.stats.llm_steps += 1
        self.stats.llm_batch_size_counts[batch_size] += 1
        if len({s.request.streaming for s in generating}) == 2:
            self.stats.mixed_steps += 1
        if while_vocoding:
            self.stats.llm_steps_while_vocoding += 1
        for event in events:
            sentence = self._by_llm_id.get(event.request_id)
            if sentence is None:  # its request ended earlier in this loop (an error of another of its sentences)
                continue
            if event.finish_reason is not None:  # its generator row is gone: vocoding comes next
                sentence.tokens_done = True
                del self._by_llm_id[event.request_id]
                sentence.llm_id = None
            ticket = sentence.request
            if event.error is not None:
                self._fail_request(ticket, as_request_error(event.error))
                continue
            if sentence.stream is not None:
                sentence.events.append(event)  # recorded by the next streams job
            elif event.token is not None:
                sentence.tokens.append(event.token)
            ticket.speech_tokens += event.token is not None
            if self.max_speech_tokens is not None and ticket.speech_tokens > self.max_speech_tokens:
                self.stats.over_limit += 1
                self._fail_request(
                    ticket,
                    DecodeLimitError(
                        f"the request's speech passed the limit of {self.max_audio_s:g} s of audio; send a shorter "
                        "text or a lower max_token_text_ratio"
                    ),
                )

    # --- out of device memory ---------------------------------------------------------------------------------

    def _llm_out_of_memory(self, generating: list[_Sentence]) -> list[TokenEvent] | None:
        """An LLM step ran out of memory and was undone: lower the live limit and pause the newest generating
        sentences past it (their KV caches dropped, so memory frees); the step runs again at the next `step`. A
        sentence alone in the step is retried at once, alone -> that step's events (None: not retried or it ended)."""
        if len(generating) == 1:
            return self._run_alone(generating[0], "an LLM step", self.llm.step)
        self._lower_live_limit("an LLM step")
        for victim in reversed(generating[1:]):  # the oldest keeps generating
            if self.generating_slots <= self.live_limit:
                break
            self._pause(victim, keep_cache=False)
            self.stats.oom_paused += 1
        return None

    def _run_alone(self, sentence: _Sentence, where: str, work: Callable[[], Any]) -> Any:
        """`sentence`'s work ran out of device memory with it alone in its LLM step or flow + vocoder run, and was
        put back: lower the live limit, wait for the running jobs, and run `work` again at once on this thread, with
        nothing else decoding -> its result. If it runs out again the sentence cannot fit even alone: its request
        ends with a 503 naming the replica's memory limit (-> None)."""
        self._lower_live_limit(where)
        wait([job.future for job in self._jobs.values()])
        try:
            return work()
        except torch.cuda.OutOfMemoryError:
            self._free_cached_memory()
        self.stats.oom_ended += 1
        limit = describe_memory_limit(self.stage.model.decoder_device, self.memory_budget_bytes)
        logger.warning("a sentence ran out of device memory in %s even alone (%s): its request ends", where, limit)
        self._fail_request(
            sentence.request,
            UnavailableError(
                f"a sentence of this request needs more device memory than this decoder replica has, {limit}, even "
                "with nothing else decoding; send shorter sentences or a lower max_token_text_ratio, or retry on a "
                "replica with a larger GPU fraction"
            ),
        )
        return None

    def _free_cached_memory(self) -> None:
        """Count an out-of-memory and hand the allocator's cached blocks back, so the retry finds them free."""
        self.stats.out_of_memory += 1
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _lower_live_limit(self, where: str) -> None:
        """After an out-of-memory: halve the live limit (at least 1) for `oom_backoff_s`."""
        self._free_cached_memory()
        self._oom_limit = max(1, min(self.live_limit, self.generating_slots) // 2)
        self._oom_until = self.clock() + self.oom_backoff_s
        self.stats.oom_live_limit = self.live_limit
        logger.warning(
            "the decoder ran out of device memory in %s; it retries with at most %d live sentences for %g s",
            where,
            self.live_limit,
            self.oom_backoff_s,
        )
        if self.on_out_of_memory is not None:
            self.on_out_of_memory(self.live_limit)

    def _relax_live_limit(self) -> None:
        """Double a live limit lowered by an out-of-memory back, each `oom_backoff_s` without another one."""
        if self._oom_limit is None or self.clock() < self._oom_until:
            return
        self._oom_limit *= 2
        self._oom_until = self.clock() + self.oom_backoff_s
        if self._oom_limit >= self.max_live:
            self._oom_limit = None
        self.stats.oom_live_limit = None if self._oom_limit is None else self.live_limit
        logger.info("the decoder's live limit is back up to %d", self.live_limit)

    # --- the flow + vocoder jobs ---------------------------------------------------------------------------

    def _start_jobs(self) -> None:
        """Hand each free lane its next job (see the module docstring)."""
        ready = [
            s for s in self._live if s.stream is not None and not s.in_job and self.streams.may_emit(s.stream, s.events)
        ]
        now = self.clock()
        first = sorted(
            (s for s in ready if not s.request.audio_started), key=lambda s: self.policy.first_audio_key(s.request, now)
        )
        by_deadline = self.policy.by_deadline
        batch = self.vocode_batch
        if FIRST not in self._jobs and first:
            self._start_streams_job(FIRST, first[:batch])
            first = first[batch:]
        if MAIN in self._jobs:
            return
        running = sorted((s for s in ready if s.request.audio_started), key=lambda s: s.recorded_at)
        whole = [s for s in self._live if s.stream is None and s.tokens_done and not s.done and not s.in_job]
        if by_deadline:
            work = self._not_held(sorted(first + running + whole, key=self._deadline))
            if work and work[0] in first:  # a first audio is due first: the first audios in their own order
                self._start_streams_job(MAIN, first[:batch])
            else:
                self._start_earliest(work)
        elif first:
            self._start_streams_job(MAIN, first[:batch])
        elif running and (not whole or self._main_turn == "streams"):
            self._start_streams_job(MAIN, running[:batch])
            self._main_turn = "whole"
        elif whole:
            self._start_whole_job(whole[:batch])
            self._main_turn = "streams"

    def _deadline(self, sentence: _Sentence) -> float:
        return self.policy.deadline(sentence.request)

    def _not_held(self, work: list[_Sentence]) -> list[_Sentence]:
        """`work` but what the policy holds back while a live stream waits for its first audio (`may_hold`)."""
        if not _awaits_first_audio(self._live):
            return work
        now = self.clock()
        return [s for s in work if not self.policy.may_hold(s.request, now)]

    def _start_earliest(self, work: list[_Sentence]) -> None:
        """The main lane's job: the earliest-deadline sentence's kind (streams or whole), the earliest of that kind."""
        if not work:
            return
        streams = work[0].stream is not None
        chosen = [s for s in work if (s.stream is not None) == streams][: self.vocode_batch]
        if streams:
            self._start_streams_job(MAIN, chosen)
        else:
            self._start_whole_job(chosen)

    def _start_whole_job(self, whole: list[_Sentence]) -> None:
        tokens = [torch.tensor(s.tokens, dtype=torch.long) for s in whole]
        self._start(MAIN, "whole", whole, self._vocode, [s.segment for s in whole], tokens)

    def _start_streams_job(self, lane: str, sentences: list[_Sentence]) -> None:
        """Take in the sentences' waiting tokens and emit the chunks they complete."""
        events = [event for s in sentences for event in s.events]
        for sentence in sentences:
            sentence.events, sentence.recorded_at = [], self.stats.llm_steps
        streams = [s.stream for s in sentences]
        self._start(lane, "streams", sentences, self._emit, self.streams, events, streams)

    def _start(
        self,
        lane: str,
        kind: Literal["streams", "whole"],
        sentences: list[_Sentence],
        work: Callable[..., Any],
        *args: Any,
    ) -> None:
        for sentence in sentences:
            sentence.in_job = True
        future = self._lanes[lane].submit(work, *args)
        self._jobs[lane] = _Job(kind, future, sentences)
        future.add_done_callback(lambda _: self._wakeup.set())

    @staticmethod
    @torch.inference_mode()
    def _emit(streams: DecodeStream, events: list[TokenEvent], chosen: list[Any]) -> list[Any]:
        """A lane: record the streams' waiting tokens, emit the chunks they complete -> [(stream, audio or error)].
        The states may have been written on the other lane's CUDA stream: taken over first, handed over after
        (engine.runtime.handoff)."""
        for state in chosen:
            take_over(state)
        try:
            streams.record(events)
            return streams.emit(chosen)
        finally:
            hand_over(chosen, streams.decoder.model.decoder_device)

    @torch.inference_mode()
    def _vocode(self, segments: list[EncodedSegment], tokens: list[torch.Tensor]) -> list[np.ndarray | Exception]:
        """A lane: flow + vocoder of whole sentences (as `SpeechDecoderStage.decode_batch`); a sentence whose work
        fails alone gets its error (out of device memory: the `torch.cuda.OutOfMemoryError`, to be retried)."""

        def vocode(rows: list[int]) -> list[np.ndarray | CosyVoiceError]:
            chosen = [segments[row] for row in rows]
            return self.stage.vocode(chosen, self.stage.tokens_to_mel(chosen, [tokens[row] for row in rows]))

        def failed(_: int, error: CosyVoiceError) -> list[Exception]:
            return [error.__cause__ if is_out_of_memory(error) else error]

        return isolate_failures(list(range(len(segments))), vocode, failed)

    def _emit_one(self, stream: Any) -> np.ndarray | CosyVoiceError:
        """The chunk of one stream (whose run ran out of memory and was put back), made on this thread; raises
        `torch.cuda.OutOfMemoryError` if it runs out again."""
        produced = self._emit(self.streams, [], [stream])
        audio = produced[0][1] if produced else np.zeros(0, dtype=np.float32)
        if isinstance(audio, torch.cuda.OutOfMemoryError):
            raise audio
        return audio

    def _vocode_one(self, sentence: _Sentence) -> np.ndarray | CosyVoiceError:
        """`_emit_one` for a whole sentence."""
        [wave] = self._vocode([sentence.segment], [torch.tensor(sentence.tokens, dtype=torch.long)])
        if isinstance(wave, torch.cuda.OutOfMemoryError):
            raise wave
        return wave

    def _finish_jobs(self) -> None:
        """Take in the finished jobs' audio (a job that raised, a bug, raises here as a failed step does)."""
        for lane, job in list(self._jobs.items()):
            if not job.future.done():
                continue
            del self._jobs[lane]
            for sentence in job.sentences:
                sentence.in_job = False
            if job.kind == "streams":
                self._take_chunks(lane, job.sentences, job.future.result())
            else:
                self._take_waves(job.sentences, job.future.result())
            for stream in job.to_release:
                self.streams.release(stream)

    def _take_chunks(self, lane: str, sentences: list[_Sentence], produced: list[Any]) -> None:
        if produced:
            self.stats.vocode_batch_size_counts[len(produced)] += 1
            self.stats.first_lane_chunks += len(produced) if lane == FIRST else 0
        by_stream = {id(s.stream): s for s in sentences if s.stream is not None}  # not cancelled meanwhile
        for stream, audio in produced:
            sentence = by_stream.get(id(stream))
            if sentence is None or sentence.request.ended:  # cancelled, or ended by an earlier error in this batch
                continue
            if isinstance(audio, torch.cuda.OutOfMemoryError):  # its stream was put back: its chunk is made again
                audio = self._run_alone(sentence, "a streams flow + vocoder run", lambda s=stream: self._emit_one(s))
                if audio is None:
                    continue
            if isinstance(audio, CosyVoiceError):
                self._fail(sentence, audio)
                continue
            if audio.size:
                sentence.outputs.append(audio)
                sentence.request.audio_started = True
            if stream.finished:
                self.streams.release(stream)
                sentence.stream = None
                sentence.done = True

    def _take_waves(self, sentences: list[_Sentence], waves: list[np.ndarray | Exception]) -> None:
        self.stats.vocode_batch_size_counts[len(sentences)] += 1
        for sentence, wave in zip(sentences, waves, strict=True):
            if sentence.done:  # cancelled while it was vocoded
                continue
            if isinstance(wave, torch.cuda.OutOfMemoryError):
                wave = self._run_alone(sentence, "a flow + vocoder run", lambda s=sentence: self._vocode_one(s))
                if wave is None:
                    continue
            if isinstance(wave, CosyVoiceError):
                self._fail(sentence, wave)
                continue
            sentence.outputs.append(wave)
            sentence.request.audio_started = True
            sentence.done = True

    # --- handing on ------------------------------------------------------------------------------------------

    def _fail(self, sentence: _Sentence, error: CosyVoiceError) -> None:
        """An error ends the whole request: its other sentences stop too."""
        self._fail_request(sentence.request, error)

    def _fail_request(self, ticket: Ticket, error: CosyVoiceError) -> None:
        if isinstance(error, RequestFailedError):
            self.stats.request_faults += 1
        self._stop(ticket, error)

    def _end_overdue(self) -> None:
        """End the requests past their time ceiling (`max_request_s` after submission), queued, live or waiting for
        their later sentences."""
        now = self.clock()
        overdue = {s.request for s in self._live if now > s.request.expires_at} | {
            t for t in (*self._queue, *self._incomplete) if now > t.expires_at
        }
        for ticket in overdue:
            self.stats.over_limit += 1
            self._stop(
                ticket,
                DecodeLimitError(
                    f"the request decoded for longer than the limit of {self.max_request_s:g} s; send a shorter text"
                ),
            )
        if overdue:
            self._live = [s for s in self._live if s.request not in overdue]

    def _flush(self, ticket: Ticket) -> None:
        """Hand on the outputs of the request's earliest unfinished sentence (later ones wait their turn)."""
        while not ticket.ended and ticket.emitted < len(ticket.sentences):
            sentence = ticket.sentences[ticket.emitted]
            for audio in sentence.outputs:
                self._hand_on(ticket, audio)
            sentence.outputs = []
            if not sentence.done:
                return
            ticket.emitted += 1
        if not ticket.ended and ticket.complete:  # else it waits for its later sentences, its slot free
            self._end(ticket, None)

    def _end(self, ticket: Ticket, last: CosyVoiceError | None) -> None:
        if ticket.ended:
            return
        self._incomplete.discard(ticket)
        if last is not None:
            self._hand_on(ticket, last)
        self._hand_on(ticket, None)
        ticket.ended = True
        if self.on_request_end is not None:
            self.on_request_end(ticket, last)

    def _hand_on(self, ticket: Ticket, item: Output) -> None:
        """Give the request's sink an output (its listener's clock counts the audio); a sink that raises (its caller
        is gone) cancels its request alone."""
        if isinstance(item, np.ndarray) and item.size:
            ticket.playback.deliver(item.size / self.stage.sample_rate, self.clock())
        try:
            ticket.sink(item)
        except Exception:
            ticket.cancelled = True


def _first_chunk_s(streams: DecodeStream) -> float:
    """Seconds of audio in a stream's first full chunk, for this model (inf: it cannot stream)."""
    if streams.strategy is None:
        return math.inf
    schedule = streams.strategy.schedule
    tokens = schedule.token_hop + schedule.token_overlap + schedule.lookahead
    return tokens / streams.decoder.model.config.speech_tokens_for(1.0)


def _awaits_first_audio(sentences: list[_Sentence]) -> bool:
    """Whether one of `sentences` streams a request that has no audio yet and is under way: not paused (a paused one
    waits for a slot, which the work held for it may be holding)."""
    return any(s.stream is not None and not s.paused and not s.request.audio_started for s in sentences)
