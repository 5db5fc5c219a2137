"""Continuous batching over every request of a decoder: one loop, one model copy, one queue.

Callers `submit` a request (its sentences, whole or streaming) from any thread; the thread that owns the
model calls `step` in a loop. One `step`:

1. takes the new submissions into the queue and drops the cancelled requests (their LLM rows and memory
   leave the live set here, before any compute);
2. runs one LLM step for every sentence that is generating tokens; the ones admitted at the previous step
   are prefilled in it and join the running batch;
3. admits queued sentences, oldest first, while the live set stays within `max_live` sentences and the
   memory budget, each sentence counted by its own estimate (`engine.memory`); the next sentence of a
   request already running goes first, as soon as the sentence before it has all its tokens, before that
   one's last audio is made (so the next sentence's tokens are generated while the current one is vocoded,
   with no round trip through the caller);
4. runs one flow + vocoder batch over the streaming sentences that completed a token hop, and one over at
   most `max_vocode_batch` whole sentences whose tokens are all there.

Between two LLM steps there is at most one flow + vocoder batch of each kind, and every step runs an LLM
step when any sentence generates: neither side waits for the other to run dry.
Outputs go to each request's `sink`, in sentence order: audio arrays (a streaming request's chunks, a
whole request's sentences), then None at the end, or a `CosyVoiceError` that ends the request.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.errors import CosyVoiceError, RequestTooLargeError
from engine.llm import TokenGenerator
from engine.memory import estimate_request_memory
from engine.pipeline import EncodedSegment, SpeechDecoderStage
from engine.streaming import DecodeStream

Output = np.ndarray | CosyVoiceError | None
Sink = Callable[[Output], None]


@dataclass(eq=False)
class _Sentence:
    segment: EncodedSegment
    request: Ticket
    memory_bytes: int
    llm_id: int | None = None  # whole sentences: their row in the generator
    stream: Any = None  # streaming sentences: their engine.streaming stream
    tokens: list[int] = field(default_factory=list)
    tokens_done: bool = False
    done: bool = False
    outputs: list[np.ndarray] = field(default_factory=list)  # made, not yet handed on (an earlier one still runs)


@dataclass(eq=False)
class Ticket:
    """One submitted request. `cancel` it (from any thread) when its caller leaves."""

    sentences: list[_Sentence]
    streaming: bool
    sink: Sink
    cancelled: bool = False
    ended: bool = False
    emitted: int = 0  # sentences fully handed to the sink
    admitted: int = 0  # sentences admitted so far


@dataclass
class SchedulerStats:
    llm_steps: int = 0
    llm_batch_size_counts: Counter[int] = field(default_factory=Counter)
    joined_running_batch: int = 0  # sentences admitted while other sentences were generating
    mixed_steps: int = 0  # LLM steps shared by whole and streaming sentences
    pipelined_sentences: int = 0  # sentences admitted while the one before them in their request was vocoded
    vocode_batch_size_counts: Counter[int] = field(default_factory=Counter)
    admitted: int = 0
    cancelled: int = 0


class Scheduler:
    """The continuous-batching loop of one decoder (see the module docstring). One thread runs `step`;
    `submit` and `cancel` may come from any other."""

    def __init__(
        self,
        stage: SpeechDecoderStage,
        max_live: int,
        memory_budget_bytes: int | None = None,
        max_vocode_batch: int = 8,
    ) -> None:
        self.stage = stage
        self.max_live = max_live
        self.memory_budget_bytes = memory_budget_bytes
        self.max_vocode_batch = max_vocode_batch
        self.llm = TokenGenerator(stage.model.llm)
        self.streams = DecodeStream(stage, [], llm=self.llm)
        self.stats = SchedulerStats()
        self._inbox: list[Ticket] = []
        self._lock = threading.Lock()
        self._queue: deque[Ticket] = deque()  # requests with sentences still to admit, in arrival order
        self._live: list[_Sentence] = []
        self._by_llm_id: dict[int, _Sentence] = {}

    # --- any thread ------------------------------------------------------------------------------------

    def memory_estimate(self, segment: EncodedSegment) -> int:
        """Bytes one sentence holds while it is live: its KV cache at its longest, flow and vocoder activations."""
        model = self.stage.model
        return estimate_request_memory(
            model.config,
            segment.text_len,
            prompt_text_tokens=len(segment.text_encoded) - segment.text_len,
            prompt_speech_tokens=max(len(segment.llm_prompt_speech_tokens), len(segment.flow_prompt_speech_tokens)),
            max_token_text_ratio=segment.sampling.max_token_text_ratio,
            dtype_bytes=model.dtype.itemsize,
        ).total_bytes

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

    def submit(self, segments: list[EncodedSegment], streaming: bool, sink: Sink) -> Ticket:
        """Queue a request (refused at once if it can never fit); it is admitted at a coming `step`."""
        if not segments:
            raise ValueError("a request needs at least one segment")
        estimates = self.check_fits(segments)
        ticket = Ticket(sentences=[], streaming=streaming, sink=sink)
        ticket.sentences = [_Sentence(s, ticket, bytes_) for s, bytes_ in zip(segments, estimates, strict=True)]
        with self._lock:
            self._inbox.append(ticket)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The caller left: the request's sentences leave the live set at the next `step`."""
        ticket.cancelled = True

    # --- the model's thread ------------------------------------------------------------------------------

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def queued(self) -> int:
        return sum(len(t.sentences) - t.admitted for t in self._queue)

    @property
    def live_bytes(self) -> int:
        return sum(s.memory_bytes for s in self._live)

    @property
    def has_work(self) -> bool:
        return bool(self._live or self._queue or self._inbox)

    @torch.inference_mode()
    def step(self) -> None:
        """One round of the loop: take in, admit, one LLM step, then the flow + vocoder work that is ready."""
        self._take_inbox()
        self._drop_cancelled()
        if self.llm.active:
            self._llm_step()
        self._admit()  # after the step: a sentence whose last token just came hands its slot on before vocoding
        self._vocode_streams()
        self._vocode_whole()
        for ticket in {sentence.request for sentence in self._live}:
            self._flush(ticket)
        self._live = [s for s in self._live if not s.done]

    def abort_all(self, error: CosyVoiceError) -> None:
        """After a step failed half-way (a bug): end every request with `error`, go on from an empty loop."""
        self._take_inbox()
        for ticket in {s.request for s in self._live} | set(self._queue):
            self._end(ticket, error)
        self._live, self._queue, self._by_llm_id = [], deque(), {}
        self.llm = TokenGenerator(self.stage.model.llm)
        self.streams = DecodeStream(self.stage, [], llm=self.llm)

    def _take_inbox(self) -> None:
        with self._lock:
            arrived, self._inbox = self._inbox, []
        self._queue.extend(arrived)

    def _drop_cancelled(self) -> None:
        cancelled = {s.request for s in self._live if s.request.cancelled} | {t for t in self._queue if t.cancelled}
        for ticket in cancelled:
            self._stop(ticket, None)
            self.stats.cancelled += 1
        self._live = [s for s in self._live if not s.done]

    def _stop(self, ticket: Ticket, last: CosyVoiceError | None) -> None:
        """End a request early (cancelled, or `last` is its error): free its generator rows and stream state."""
        for sentence in ticket.sentences[ticket.emitted : ticket.admitted]:
            if sentence.stream is not None:
                self.streams.release(sentence.stream)
                sentence.stream = None
            if sentence.llm_id is not None:
                self.llm.cancel(sentence.llm_id)
                del self._by_llm_id[sentence.llm_id]
                sentence.llm_id = None
        for sentence in ticket.sentences:
            sentence.done = True
        if ticket in self._queue:
            self._queue.remove(ticket)
        self._end(ticket, last)

    def _next_to_admit(self) -> Ticket | None:
        """A running request whose admitted sentences all have their tokens goes first (pipelining); then the
        oldest request not started yet."""
        for ticket in self._queue:
            if ticket.admitted and all(s.tokens_done for s in ticket.sentences[: ticket.admitted]):
                return ticket
        return next((ticket for ticket in self._queue if not ticket.admitted), None)

    def _admit(self) -> None:
        while (ticket := self._next_to_admit()) is not None:
            sentence = ticket.sentences[ticket.admitted]
            budget = self.memory_budget_bytes
            if len(self._live) >= self.max_live or (
                budget is not None and self._live and self.live_bytes + sentence.memory_bytes > budget
            ):
                return
            if self.llm.batch_size:
                self.stats.joined_running_batch += 1
            if ticket.admitted and not ticket.sentences[ticket.admitted - 1].done:
                self.stats.pipelined_sentences += 1
            if ticket.streaming:
                sentence.stream = self.streams.add(sentence.segment)
            else:
                [request] = self.stage.generation_requests([sentence.segment])
                sentence.llm_id = self.llm.add(request)
                self._by_llm_id[sentence.llm_id] = sentence
            ticket.admitted += 1
            self.stats.admitted += 1
            self._live.append(sentence)
            if ticket.admitted == len(ticket.sentences):
                self._queue.remove(ticket)

    def _llm_step(self) -> None:
        generating = [s for s in self._live if not s.tokens_done]
        self.stats.llm_steps += 1
        self.stats.llm_batch_size_counts[self.llm.active] += 1
        if len({s.request.streaming for s in generating}) == 2:
            self.stats.mixed_steps += 1
        events = self.llm.step()
        self.streams.record(events)
        whole = [(self._by_llm_id[e.request_id], e) for e in events if e.request_id in self._by_llm_id]
        for sentence, event in whole:
            sentence.tokens += [] if event.token is None else [event.token]
            if event.finish_reason is not None:  # its generator row is gone: vocoding comes next
                sentence.tokens_done = True
                del self._by_llm_id[event.request_id]
                sentence.llm_id = None
        for sentence in self._live:
            if sentence.stream is not None and sentence.stream.tokens_done:
                sentence.tokens_done = True

    def _vocode_streams(self) -> None:
        produced = self.streams.emit()
        if produced:
            self.stats.vocode_batch_size_counts[len(produced)] += 1
        by_stream = {id(s.stream): s for s in self._live if s.stream is not None}
        for stream, audio in produced:
            sentence = by_stream[id(stream)]
            if sentence.request.ended:  # an earlier error in this batch ended its request
                continue
            if isinstance(audio, CosyVoiceError):
                self._fail(sentence, audio)
                continue
            if audio.size:
                sentence.outputs.append(audio)
            if stream.finished:
                self.streams.release(stream)
                sentence.stream = None
                sentence.done = True

    def _vocode_whole(self) -> None:
        ready = [s for s in self._live if s.stream is None and s.tokens_done and not s.done]
        ready = ready[: self.max_vocode_batch]
        if not ready:
            return
        self.stats.vocode_batch_size_counts[len(ready)] += 1
        segments = [s.segment for s in ready]
        tokens = [torch.tensor(s.tokens, dtype=torch.long) for s in ready]
        waves = self.stage.vocode(segments, self.stage.tokens_to_mel(segments, tokens))
        for sentence, wave in zip(ready, waves, strict=True):
            if isinstance(wave, CosyVoiceError):
                self._fail(sentence, wave)
                continue
            sentence.outputs.append(wave)
            sentence.done = True

    def _fail(self, sentence: _Sentence, error: CosyVoiceError) -> None:
        """An error ends the whole request: its other sentences stop too."""
        self._stop(sentence.request, error)

    def _flush(self, ticket: Ticket) -> None:
        """Hand on the outputs of the request's earliest unfinished sentence (later ones wait their turn)."""
        while not ticket.ended and ticket.emitted < len(ticket.sentences):
            sentence = ticket.sentences[ticket.emitted]
            for audio in sentence.outputs:
                ticket.sink(audio)
            sentence.outputs = []
            if not sentence.done:
                return
            ticket.emitted += 1
        if not ticket.ended:
            self._end(ticket, None)

    def _end(self, ticket: Ticket, last: CosyVoiceError | None) -> None:
        if ticket.ended:
            return
        if last is not None:
            ticket.sink(last)
        ticket.sink(None)
        ticket.ended = True
