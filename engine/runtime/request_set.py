"""The requests a decoder loop holds (queued, live, waiting for their later sentences) and how each one ends: its
outputs handed on in sentence order, then None, or the error that ends it alone."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from engine.errors import CosyVoiceError, DecodeLimitError, RequestFailedError
from engine.runtime.handoff import SharedGenerator
from engine.runtime.lanes import FIRST, Lanes
from engine.runtime.loop_state import Output, SchedulerStats, Sentence, Ticket
from engine.runtime.playback import SECONDS_PER_TEXT_TOKEN
from engine.runtime.streaming import DecodeStream

# (sentence, where, work) -> work's result, run again alone after running out of device memory; None: it ended
RetryAlone = Callable[[Sentence, str, Callable[[], Any]], Any]


class RequestSet:
    """Every request of the loop, from its arrival to its end. Used on the loop thread only (the counts may be read
    from any thread)."""

    def __init__(
        self,
        llm: SharedGenerator,
        streams: DecodeStream,
        lanes: Lanes,
        stats: SchedulerStats,
        sample_rate: int,
        clock: Callable[[], float] = time.monotonic,
        on_request_end: Callable[[Ticket, CosyVoiceError | None], None] | None = None,
    ) -> None:
        self.llm, self.streams, self.lanes, self.stats, self.clock = llm, streams, lanes, stats, clock
        self.sample_rate = sample_rate
        self.on_request_end = on_request_end
        self.queue: deque[Ticket] = deque()  # requests with sentences still to admit, in arrival order
        self.incomplete: set[Ticket] = set()  # requests whose later sentences may still come
        self.live: list[Sentence] = []  # admitted, not yet done
        self.by_llm_id: dict[int, Sentence] = {}

    @property
    def queued(self) -> int:
        return sum(len(t.sentences) - t.admitted for t in tuple(self.queue))

    @property
    def live_bytes(self) -> int:
        """Memory the live sentences hold (a sentence paused without its KV cache holds none)."""
        return sum(s.memory_bytes for s in tuple(self.live) if not s.paused or s.cache_kept)

    @property
    def generating_slots(self) -> int:
        """Live sentences that count against the live limit: all but the paused ones."""
        return sum(not s.paused for s in tuple(self.live))

    def tickets_where(self, holds: Callable[[Ticket], bool]) -> set[Ticket]:
        """The requests, queued, live or waiting for their later sentences, for which `holds`."""
        held = {s.request for s in self.live} | set(self.queue) | self.incomplete
        return {ticket for ticket in held if holds(ticket)}

    def take_arrivals(self, arrived: list[Ticket]) -> None:
        self.queue.extend(arrived)
        self.incomplete.update(t for t in arrived if not t.complete)

    def add_sentences(self, ticket: Ticket, sentences: list[Sentence], final: bool) -> None:
        """A request's later sentences came (the last ones if `final`); a request that ended meanwhile ignores them."""
        if ticket.ended:
            return
        ticket.playback.estimated_audio_s += sum(s.segment.text_len for s in sentences) * SECONDS_PER_TEXT_TOKEN
        ticket.sentences += sentences
        if final:
            ticket.complete = True
            self.incomplete.discard(ticket)
        if ticket.admitted < len(ticket.sentences) and ticket not in self.queue:
            self.queue.append(ticket)
        self.flush(ticket)  # ends a request whose every sentence was handed on before its last word came

    def add_text(self, ticket: Ticket, tokens: list[int] | None) -> None:
        """A bi-streamed utterance's next text piece (None: its text ended)."""
        if not ticket.ended:
            ticket.sentences[0].text_pieces.append(tokens)
            ticket.playback.estimated_audio_s += len(tokens or ()) * SECONDS_PER_TEXT_TOKEN

    def abort(self, ticket: Ticket, error: CosyVoiceError) -> None:
        """End a request with `error` from outside its work (its later sentences or text cannot come)."""
        if not ticket.ended:
            self.fail(ticket, error)
            self.drop({ticket})

    def end_all(self, error: CosyVoiceError) -> None:
        """The loop failed: every request ends with `error`."""
        for ticket in {s.request for s in self.live} | set(self.queue) | self.incomplete:
            self.end(ticket, error)
        self.live, self.queue, self.by_llm_id, self.incomplete = [], deque(), {}, set()

    def drop(self, tickets: set[Ticket]) -> None:
        """Forget the live sentences of requests that ended."""
        if tickets:
            self.live = [s for s in self.live if s.request not in tickets]

    def stop(self, ticket: Ticket, last: CosyVoiceError | None) -> None:
        """End a request early (cancelled, or `last` is its error): free its generator rows and stream state."""
        for sentence in ticket.sentences[ticket.emitted : ticket.admitted]:
            if sentence.stream is not None:
                self.streams.stop(sentence.stream)  # its generator row goes now
                self.lanes.release(sentence)
                sentence.stream = None
            elif sentence.llm_id is not None:
                self.llm.cancel(sentence.llm_id)
            if sentence.llm_id is not None:
                del self.by_llm_id[sentence.llm_id]
                sentence.llm_id = None
            sentence.bistream = None  # its LM's KV cache goes with it
        for sentence in ticket.sentences:
            sentence.done = True
        if ticket in self.queue:
            self.queue.remove(ticket)
        self.end(ticket, last)

    def fail(self, ticket: Ticket, error: CosyVoiceError) -> None:
        """An error ends the whole request: its other sentences stop too."""
        if isinstance(error, RequestFailedError):
            self.stats.request_faults += 1
        self.stop(ticket, error)

    def end_over_time(self, max_request_s: float | None) -> None:
        """End the requests past their time ceiling (`max_request_s` after submission)."""
        now = self.clock()
        overdue = self.tickets_where(lambda ticket: now > ticket.expires_at)
        for ticket in overdue:
            self.stats.over_limit += 1
            self.stop(
                ticket,
                DecodeLimitError(
                    f"the request decoded for longer than the limit of {max_request_s:g} s; send a shorter text"
                ),
            )
        self.drop(overdue)

    def flush(self, ticket: Ticket) -> None:
        """Hand on the outputs of the request's earliest unfinished sentence (later ones wait their turn)."""
        while not ticket.ended and ticket.emitted < len(ticket.sentences):
            sentence = ticket.sentences[ticket.emitted]
            for audio in sentence.outputs:
                self.hand_on(ticket, audio)
            sentence.outputs = []
            if not sentence.done:
                return
            ticket.emitted += 1
        if not ticket.ended and ticket.complete:  # else it waits for its later sentences, its slot free
            self.end(ticket, None)

    def end(self, ticket: Ticket, last: CosyVoiceError | None) -> None:
        if ticket.ended:
            return
        self.incomplete.discard(ticket)
        if last is not None:
            self.hand_on(ticket, last)
        self.hand_on(ticket, None)
        ticket.ended = True
        if self.on_request_end is not None:
            self.on_request_end(ticket, last)

    def take_chunks(self, lane: str, sentences: list[Sentence], produced: list[Any], retry: RetryAlone) -> None:
        """A streams job's chunks -> their sentences' outputs; a chunk that ran out of device memory is made again
        alone (`retry`: `LiveLimits.run_alone`)."""
        if produced:
            self.stats.vocode_batch_size_counts[len(produced)] += 1
            self.stats.first_lane_chunks += len(produced) if lane == FIRST else 0
        by_stream = {id(s.stream): s for s in sentences if s.stream is not None}  # not cancelled meanwhile
        for stream, audio in produced:
            sentence = by_stream.get(id(stream))
            if sentence is None or sentence.request.ended:  # cancelled, or ended by an earlier error in this batch
                continue
            if isinstance(audio, torch.cuda.OutOfMemoryError):  # its stream was put back: its chunk is made again
                audio = retry(sentence, "a streams flow + vocoder run", partial(self.lanes.emit_one, stream))
                if audio is None:
                    continue
            if isinstance(audio, CosyVoiceError):
                self.fail(sentence.request, audio)
                continue
            if audio.size:
                sentence.outputs.append(audio)
                sentence.request.audio_started = True
            if stream.finished:
                self.streams.release(stream)
                sentence.stream = None
                sentence.done = True

    def take_waves(self, sentences: list[Sentence], waves: list[np.ndarray | Exception], retry: RetryAlone) -> None:
        """A whole-sentences job's waveforms -> their sentences' outputs (`take_chunks` for whole sentences)."""
        self.stats.vocode_batch_size_counts[len(sentences)] += 1
        for sentence, wave in zip(sentences, waves, strict=True):
            if sentence.done:  # cancelled while it was vocoded
                continue
            if isinstance(wave, torch.cuda.OutOfMemoryError):
                wave = retry(sentence, "a flow + vocoder run", partial(self.lanes.vocode_one, sentence))
                if wave is None:
                    continue
            if isinstance(wave, CosyVoiceError):
                self.fail(sentence.request, wave)
                continue
            sentence.outputs.append(wave)
            sentence.request.audio_started = True
            sentence.done = True

    def hand_on(self, ticket: Ticket, item: Output) -> None:
        """Give the request's sink an output (its listener's clock counts the audio); a sink that raises (its caller
        is gone) cancels its request alone."""
        if isinstance(item, np.ndarray) and item.size:
            ticket.playback.deliver(item.size / self.sample_rate, self.clock())
        try:
            ticket.sink(item)
        except Exception:
            ticket.cancelled = True
