"""Continuous batching over every request of a decoder: one loop, one model copy, one queue, three threads.

Callers `submit` a request (its sentences, whole or streaming) from any thread; a request submitted incomplete gets
its later sentences by `extend` as they are encoded, and ends once they are all there and done, or with an error of
theirs (`abort`). The loop thread calls `step` again and again (`run`): one step takes in the finished flow + vocoder
jobs, the new submissions and the cancellations, hands on the audio made, runs one LLM step for every generating
sentence, admits sentences (`engine.runtime.admission`) and hands each free lane its next job
(`engine.runtime.lanes`). The requests and how they end: `engine.runtime.request_set`; the live limits and their
back-off after running out of device memory: `engine.runtime.live_limits`. docs/scheduler.md tells the whole design.

The loop serves many requests at once, so a fault is the failing request's alone wherever one request explains it
(its segment is checked at submission; its admission, prefill, sampling, flow or vocoder raising ends it alone). A
step that raises beyond that ends the loop: every request gets the error, later submissions are refused with
`UnavailableError`, and `failure` tells the replica to have itself replaced.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from functools import partial

import torch

from engine.errors import (
    CosyVoiceError,
    InvalidInputError,
    UnavailableError,
)
from engine.llm.generation import TokenGenerator
from engine.runtime.admission import Admission
from engine.runtime.bistream import BistreamStart, check_bistream, check_text_piece
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.handoff import SharedGenerator
from engine.runtime.lanes import Lanes
from engine.runtime.live_limits import OOM_BACKOFF_S, LiveLimits
from engine.runtime.llm_steps import LlmSteps
from engine.runtime.loop_state import Output, SchedulerStats, Sentence, Sink, Ticket
from engine.runtime.playback import SECONDS_PER_TEXT_TOKEN, DeadlinePolicy, PlaybackClock, SchedulingPolicy
from engine.runtime.prompt_cache import DEFAULT_PROMPT_CACHE_SHARE, PromptCache, prompt_cache_bound
from engine.runtime.request_set import RequestSet
from engine.runtime.segment import EncodedSegment
from engine.runtime.streaming import DecodeStream

__all__ = ["Output", "Scheduler", "Sink", "Ticket"]

# Sentences (or streams) per flow + vocoder job, at most: on a GPU a job takes milliseconds and batching pays; on CPU
# the flow and vocoder run only ~1.2x faster at batch 8 than 1 (docs/performance.md), and a job runs to its end, so
# small ones let a new request's first chunk wait less. The tests pass their own.
DEFAULT_VOCODE_BATCH_CUDA, DEFAULT_VOCODE_BATCH_CPU = 8, 1


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
        memory budget. Its bytes count against the budget: a sentence that needs them empties it, oldest entries
        first. `hold_rows`: whether the generating sentences the policy may hold sit out of the LLM steps while a
        stream generates toward its first audio; None: on CPU only."""
        self.stage, self.clock = stage, clock
        self.policy: SchedulingPolicy = policy or DeadlinePolicy()
        self.max_audio_s, self.max_request_s = max_audio_s, max_request_s
        self.max_speech_tokens = None if max_audio_s is None else stage.model.config.speech_tokens_for(max_audio_s)
        self.failure: Exception | None = None  # what ended the loop: the replica should be replaced
        device = stage.model.decoder_device
        self.max_vocode_batch = max_vocode_batch or (
            DEFAULT_VOCODE_BATCH_CUDA if device.type == "cuda" else DEFAULT_VOCODE_BATCH_CPU
        )
        # On CPU an LLM step grows with its rows (tiny v1: 0.8 ms at 1 row, 2.3 ms at 8), so the rows the policy may
        # hold sit out while a stream generates toward its first audio; on a GPU a decode step is bound by reading the
        # weights, much the same at 1 or 8 rows (not measured: no GPU yet), so setting KV caches aside would only cost
        # copies.
        hold_rows = device.type == "cpu" if hold_rows is None else hold_rows
        if prompt_cache_bytes is None:
            prompt_cache_bytes = prompt_cache_bound(memory_budget_bytes, DEFAULT_PROMPT_CACHE_SHARE)
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        stage.prompt_cache = self.prompt_cache  # the stage prepares the prompts: the loop owns their memory
        self.llm = SharedGenerator(TokenGenerator(stage.model.llm), device)
        self.streams = DecodeStream(stage, [], llm=self.llm)
        self._first_chunk_s = _first_chunk_s(self.streams)
        self.stats = SchedulerStats()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()  # set by submit, cancel and a finished job
        self._inbox: list[Ticket] = []
        self._later: list[Callable[[], None]] = []  # incomplete requests' later sentences or errors, in order
        self.lanes = Lanes(stage, self.streams, self.policy, self.stats, self._wakeup, clock)
        self.requests = RequestSet(
            self.llm, self.streams, self.lanes, self.stats, stage.sample_rate, clock, on_request_end
        )
        self.limits = LiveLimits(
            max_live, memory_budget_bytes, stage.model, self.requests, on_out_of_memory, oom_backoff_s
        )
        self.admission = Admission(stage, self.requests, self.limits, self.policy, self.prompt_cache, hold_rows)
        self.llm_steps = LlmSteps(self.requests, self.limits, self.admission, max_audio_s, self.max_speech_tokens)

    # --- any thread ------------------------------------------------------------------------------------

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
        ticket = self._ticket(now, streaming, sink, playback, complete)
        ticket.sentences = self._checked_sentences(ticket, segments)
        return self._queue(ticket)

    def submit_bistream(self, start: BistreamStart, sink: Sink) -> Ticket:
        """Queue a bi-streamed utterance (CosyVoice2/3): its text comes by `push_text`, its audio goes to `sink` as
        a stream's does. It is a request like the others: a slot, the memory budget, the ceilings, cancellation."""
        check_bistream(self.stage.model.config.family)
        self.streams.check_streamable(start.voice)
        now = self.clock()
        ticket = self._ticket(now, True, sink, PlaybackClock(now, 0.0, first_chunk_s=self._first_chunk_s))
        ticket.sentences = [Sentence(start.voice, ticket, self.limits.bistream_estimate(start), bistream_start=start)]
        return self._queue(ticket)

    def push_text(self, ticket: Ticket, tokens: list[int] | None) -> None:
        """The next text piece's ids of a bi-streamed utterance (`submit_bistream`); None: its text ended."""
        if tokens is not None:
            check_text_piece(self.stage.model, tokens)
        with self._lock:
            self._check_running()
            self._later.append(partial(self.requests.add_text, ticket, tokens))
        self._wakeup.set()

    def extend(self, ticket: Ticket, segments: list[EncodedSegment], final: bool) -> None:
        """Queue the next sentences of a request submitted incomplete, after those it has (the last ones if `final`).
        Refused, the request unchanged, as `submit` refuses (the caller then ends it: `abort`)."""
        if not isinstance(segments, list):
            raise InvalidInputError("later sentences come as a list of segments")
        sentences = self._checked_sentences(ticket, segments)
        with self._lock:
            self._check_running()
            self._later.append(partial(self.requests.add_sentences, ticket, sentences, final))
        self._wakeup.set()

    def abort(self, ticket: Ticket, error: CosyVoiceError) -> None:
        """End a request with `error` at the next `step` (its later sentences cannot come: their encoding failed, or
        one was refused)."""
        with self._lock:
            if self.failure is None:  # else the failure ended it
                self._later.append(partial(self.requests.abort, ticket, error))
        self._wakeup.set()

    def cancel(self, ticket: Ticket) -> None:
        """The caller left: the request's sentences leave the live set at the next `step`."""
        ticket.cancelled = True
        self._wakeup.set()

    def _ticket(
        self, now: float, streaming: bool, sink: Sink, playback: PlaybackClock, complete: bool = True
    ) -> Ticket:
        """A request arriving `now`, its sentences still to be set; it expires `max_request_s` later."""
        expires_at = now + (self.max_request_s if self.max_request_s is not None else math.inf)
        return Ticket([], streaming, sink, playback, expires_at, complete=complete)

    def _queue(self, ticket: Ticket) -> Ticket:
        """Hand a new request to the loop (refused once the loop has failed)."""
        with self._lock:
            self._check_running()
            self._inbox.append(ticket)
        self._wakeup.set()
        return ticket

    def _checked_sentences(self, ticket: Ticket, segments: list[EncodedSegment]) -> list[Sentence]:
        for segment in segments:  # here, not at admission: work refused inside `step` costs the loop a step
            self.stage.check_segment(segment)
            if ticket.streaming:
                self.streams.check_streamable(segment)
        estimates = self.limits.check_fits(segments)
        return [Sentence(s, ticket, bytes_) for s, bytes_ in zip(segments, estimates, strict=True)]

    def _check_running(self) -> None:
        if self.failure is not None:
            raise UnavailableError("this decoder replica's loop failed and the replica is being replaced; retry")

    @property
    def live(self) -> int:
        return len(self.requests.live)

    @property
    def queued(self) -> int:
        return self.requests.queued

    @property
    def live_bytes(self) -> int:
        return self.requests.live_bytes

    @property
    def live_limit(self) -> int:
        """The live sentences admitted now (also the flow + vocoder batch cap): `LiveLimits.live_limit`."""
        return self.limits.live_limit

    @property
    def awaiting_sentences(self) -> int:
        """Requests whose later sentences may still come."""
        return len(self.requests.incomplete)

    @property
    def has_work(self) -> bool:
        requests = self.requests
        busy = requests.live or requests.queue or self._inbox or self._later or self.lanes.jobs
        return bool(busy) or self._incomplete_due()

    def _incomplete_due(self) -> bool:
        """A request waiting for its later sentences must end now: cancelled, or past its time ceiling."""
        now = self.clock()
        return any(t.cancelled or now > t.expires_at for t in tuple(self.requests.incomplete))

    def _until_incomplete_expires(self) -> float | None:
        """Seconds until the first time ceiling of a request waiting for its later sentences; None: no such one."""
        expires_at = min((t.expires_at for t in tuple(self.requests.incomplete)), default=math.inf)
        return None if math.isinf(expires_at) else max(0.0, expires_at - self.clock())

    # --- the loop thread ---------------------------------------------------------------------------------

    def run(self, on_busy: Callable[[bool], None], on_error: Callable[[Exception], CosyVoiceError]) -> None:
        """Run the loop in the calling thread until it fails: steps while there is work, asleep otherwise.

        `on_busy(True)` when work arrives at an idle loop, `on_busy(False)` when the loop runs out of it. A step
        that raises (a fault no single request explains: a request's own end that request alone) ends every request
        with `on_error(exc)` and the loop (`fail`)."""
        torch.set_num_threads(self.lanes.loop_threads)
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
        requests = self.requests
        self._wait_if_idle()
        self.limits.relax()
        self._finish_jobs()
        self._take_inbox()
        self._drop_cancelled()
        requests.end_over_time(self.max_request_s)
        # the audio made is handed on before anything is chosen: a request's deadline moves with its playback clock
        for ticket in {sentence.request for sentence in requests.live}:
            requests.flush(ticket)
        self.llm_steps.step()
        self.admission.admit()  # after the step: a sentence whose last token just came hands its slot on first
        self.lanes.start_jobs(requests.live, min(self.max_vocode_batch, self.live_limit))
        self.admission.hold_rows_for_first_audio()  # here: a loop about to wait for a job knows which rows generate
        requests.live = [s for s in requests.live if not s.done]

    def fail(self, cause: Exception, error: CosyVoiceError) -> None:
        """A step failed half-way, with a fault no single request explains: the loop's state is suspect, so every
        request ends with `error`, later submissions are refused, and `failure` is `cause`."""
        with self._lock:
            self.failure = cause
        self._take_inbox()
        self.requests.end_all(error)
        self.lanes.drop()  # a running job's results are dropped

    def _wait_if_idle(self) -> None:
        """With nothing to generate or admit, wait for a running job, or for text when every live sentence is a
        bi-stream waiting for it (or for a new request, a cancel, a ceiling): the last step started every job that
        could start."""
        self._wakeup.clear()  # what sets it after this line is seen by the wait; what set it before, by the checks
        live = self.requests.live
        if self.lanes.jobs:
            if not self.lanes.all_running:
                return
        elif not live or not all(_waits_for_text(s) for s in live):
            return
        if self.llm.active or self._inbox or self._later or self.admission.admissible():
            return
        if any(s.request.cancelled for s in live) or self._incomplete_due():
            return
        if any(s.bistream is not None and (s.bistream.decoding or s.text_pieces) for s in live):
            return
        expires_at = min((s.request.expires_at for s in live), default=math.inf)
        self._wakeup.wait(None if math.isinf(expires_at) else max(0.0, expires_at - self.clock()))

    def _take_inbox(self) -> None:
        with self._lock:  # one take: a request's later sentences never come in before it
            arrived, self._inbox = self._inbox, []
            later, self._later = self._later, []
        self.requests.take_arrivals(arrived)
        for take in later:
            take()

    def _drop_cancelled(self) -> None:
        cancelled = self.requests.tickets_where(lambda ticket: ticket.cancelled)
        for ticket in cancelled:
            self.requests.stop(ticket, None)
            self.stats.cancelled += 1
        self.requests.drop(cancelled)

    # --- the flow + vocoder jobs' results --------------------------------------------------------------------

    def _finish_jobs(self) -> None:
        """Take in the finished jobs' audio (a job that raised, a bug, raises here as a failed step does)."""
        for lane, job in self.lanes.take_finished():
            if job.kind == "streams":
                self.requests.take_chunks(lane, job.sentences, job.future.result(), self.limits.run_alone)
            else:
                self.requests.take_waves(job.sentences, job.future.result(), self.limits.run_alone)
            self.lanes.forget_released(job)


def _waits_for_text(sentence: Sentence) -> bool:
    """A bi-streamed sentence whose LM waits for its next text piece, with none there."""
    decoder = sentence.bistream
    return decoder is not None and not decoder.decoding and not sentence.text_pieces and not sentence.tokens_done


def _first_chunk_s(streams: DecodeStream) -> float:
    """Seconds of audio in a stream's first full chunk, for this model (inf: it cannot stream)."""
    if streams.strategy is None:
        return math.inf
    schedule = streams.strategy.schedule
    tokens = schedule.token_hop + schedule.token_overlap + schedule.lookahead
    return tokens / streams.decoder.model.config.speech_tokens_for(1.0)
