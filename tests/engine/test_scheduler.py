"""The continuous-batching scheduler (engine.runtime.scheduler) on the tiny model: joining, equality with a request
decoded alone, cancellation, memory admission, refusal, pipelined sentences, and the vocoding thread (LLM steps
go on while it works, first chunks go first), and requests whose later sentences come after their submission."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from engine.errors import CosyVoiceError, DecodeLimitError, RequestTooLargeError, UnavailableError
from engine.llm.sampling import SamplingOptions
from engine.runtime.pipeline import CosyVoice
from engine.runtime.playback import FcfsPolicy
from engine.runtime.scheduler import Scheduler
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import SynthesisRequest
from tests.engine.conftest import Collected, step_until

SHORT = SamplingOptions(seed=3, min_token_text_ratio=6, max_token_text_ratio=6)
LONG = SamplingOptions(seed=4, min_token_text_ratio=30, max_token_text_ratio=30)  # several stream chunks


@pytest.fixture(scope="module")
def tts() -> CosyVoice:
    return CosyVoice.load("tiny")


def _segments(tts: CosyVoice, text: str, sampling: SamplingOptions) -> list[EncodedSegment]:
    return tts.encoder.encode(SynthesisRequest(text, tts.voices[0], sampling=sampling))


def _run(scheduler: Scheduler, steps: int | None = None) -> None:
    count = 0
    while scheduler.has_work and (steps is None or count < steps):
        scheduler.step()
        count += 1


def _stream_alone(tts: CosyVoice, segment: EncodedSegment) -> list[np.ndarray]:
    return [out[0] for out in tts.decoder.open_stream([segment]) if out[0] is not None and out[0].size]


def test_requests_decoded_in_the_loop_equal_the_same_requests_decoded_alone(tts: CosyVoice) -> None:
    [whole] = _segments(tts, "A whole request in the loop.", SHORT)
    [streamed] = _segments(tts, "A streaming request that arrives later.", LONG)
    [other] = _segments(tts, "Another whole one.", SamplingOptions(seed=9, max_token_text_ratio=8))
    [short_stream] = _segments(tts, "Short.", SHORT)  # streams after the long one, ends first
    scheduler = Scheduler(tts.decoder, max_live=8)
    whole_sink, stream_sink, other_sink, short_sink = Collected(), Collected(), Collected(), Collected()
    scheduler.submit([whole], streaming=False, sink=whole_sink)
    scheduler.submit([other], streaming=False, sink=other_sink)
    _run(scheduler, steps=5)
    scheduler.submit([streamed], streaming=True, sink=stream_sink)
    scheduler.submit([short_stream], streaming=True, sink=short_sink)
    _run(scheduler)

    [alone_whole] = tts.decoder.decode_batch([whole])
    [in_loop] = whole_sink.chunks
    assert in_loop.shape == alone_whole.shape
    np.testing.assert_allclose(in_loop, alone_whole, atol=1e-4)
    alone_chunks = _stream_alone(tts, streamed)
    assert [len(c) for c in stream_sink.chunks] == [len(c) for c in alone_chunks]
    np.testing.assert_allclose(np.concatenate(stream_sink.chunks), np.concatenate(alone_chunks), atol=1e-4)
    np.testing.assert_allclose(
        np.concatenate(short_sink.chunks), np.concatenate(_stream_alone(tts, short_stream)), atol=1e-4
    )
    assert other_sink.ended and scheduler.live == 0 and scheduler.llm.active == 0


def test_after_a_failed_step_every_request_ends_with_the_error_and_the_loop_refuses_more(tts: CosyVoice) -> None:
    [segment] = _segments(tts, "Caught in a broken loop.", LONG)
    scheduler = Scheduler(tts.decoder, max_live=1)
    running, waiting = Collected(), Collected()
    scheduler.submit([segment], streaming=True, sink=running)
    _run(scheduler, steps=2)
    scheduler.submit([segment], streaming=False, sink=waiting)
    cause = RuntimeError("a fault of the whole batch")
    scheduler.fail(cause, CosyVoiceError("the loop failed"))
    for sink in (running, waiting):
        assert isinstance(sink.outputs[-2], CosyVoiceError) and sink.ended
    assert not scheduler.has_work and scheduler.failure is cause
    with pytest.raises(UnavailableError):
        scheduler.submit([segment], streaming=False, sink=Collected())


def test_a_request_submitted_while_a_batch_runs_joins_the_running_llm_batch(tts: CosyVoice) -> None:
    [first] = _segments(tts, "The first request starts alone.", LONG)
    [second] = _segments(tts, "The second joins it.", SHORT)
    scheduler = Scheduler(tts.decoder, max_live=8, hold_rows=False)  # as on a GPU: no row sits out a first audio
    scheduler.submit([first], streaming=True, sink=Collected())
    _run(scheduler, steps=3)
    assert scheduler.stats.llm_batch_size_counts == {1: 2}  # the first step only admitted it
    scheduler.submit([second], streaming=False, sink=Collected())
    scheduler.step()  # admitted after this step's LLM step: prefilled in the next one
    scheduler.step()
    assert scheduler.stats.joined_running_batch == 1
    assert scheduler.stats.llm_batch_size_counts[2] == 1  # one LLM step ran both
    assert scheduler.stats.mixed_steps == 1  # a whole and a streaming request in that step
    _run(scheduler)


@pytest.mark.parametrize("streaming", [False, True])
def test_cancelling_frees_the_slot_at_the_next_step(tts: CosyVoice, streaming: bool) -> None:
    [segment] = _segments(tts, "A request whose caller leaves.", LONG)
    scheduler = Scheduler(tts.decoder, max_live=1)
    sink = Collected()
    ticket = scheduler.submit([segment], streaming=streaming, sink=sink)
    _run(scheduler, steps=4)
    assert scheduler.live == 1 and scheduler.llm.active == 1
    waiting_sink = Collected()
    scheduler.submit([segment], streaming=streaming, sink=waiting_sink)
    scheduler.step()
    assert scheduler.queued == 1  # max_live 1: the second waits for the slot
    scheduler.cancel(ticket)
    scheduler.step()
    assert sink.ended and scheduler.stats.cancelled == 1
    assert scheduler.live == 1 and scheduler.queued == 0  # the freed slot went to the waiting request
    assert scheduler.llm.active == 1  # the cancelled request's row is gone
    _run(scheduler)
    assert waiting_sink.ended


def test_a_request_that_can_never_fit_is_refused_before_it_is_queued(tts: CosyVoice) -> None:
    [segment] = _segments(tts, "Too long for this budget.", LONG)
    estimate = Scheduler(tts.decoder, max_live=4).limits.memory_estimate(segment)
    scheduler = Scheduler(tts.decoder, max_live=4, memory_budget_bytes=estimate - 1)
    with pytest.raises(RequestTooLargeError, match="budget"):
        scheduler.submit([segment], streaming=False, sink=Collected())
    assert not scheduler.has_work


def test_the_memory_budget_counts_each_request_by_its_own_length(tts: CosyVoice) -> None:
    [short] = _segments(tts, "Short.", SHORT)
    [long] = _segments(tts, "A far longer sentence, with many more words in it than the short one.", LONG)
    probe = Scheduler(tts.decoder, max_live=8)
    short_bytes, long_bytes = probe.limits.memory_estimate(short), probe.limits.memory_estimate(long)
    assert long_bytes > 3 * short_bytes
    # Room for the long one and two short ones, not for two long ones.
    budget = long_bytes + 2 * short_bytes
    scheduler = Scheduler(tts.decoder, max_live=8, memory_budget_bytes=budget, policy=FcfsPolicy())
    for segment in (long, long, short, short):
        scheduler.submit([segment], streaming=False, sink=Collected())
    scheduler.step()
    assert scheduler.live == 1 and scheduler.live_bytes == long_bytes  # FIFO: the second long one waits
    live_bytes = []
    while scheduler.has_work:
        scheduler.step()
        live_bytes.append(scheduler.live_bytes)
    assert max(live_bytes) <= long_bytes + 2 * short_bytes


def test_the_sentences_of_a_request_are_pipelined_and_arrive_in_order(tts: CosyVoice) -> None:
    text = " ".join(["This sentence is here to make the paragraph long enough to be split."] * 8)
    segments = _segments(tts, text, SamplingOptions(seed=5, min_token_text_ratio=3, max_token_text_ratio=3))
    assert len(segments) == 2
    scheduler = Scheduler(tts.decoder, max_live=8)
    sink = Collected()
    scheduler.submit(segments, streaming=True, sink=sink)
    _run(scheduler)
    assert scheduler.stats.pipelined_sentences == 1  # the second started before the first's last audio
    expected = [chunk for segment in segments for chunk in _stream_alone(tts, segment)]
    assert [len(c) for c in sink.chunks] == [len(c) for c in expected]
    np.testing.assert_allclose(np.concatenate(sink.chunks), np.concatenate(expected), atol=1e-4)


class Gate:
    """Holds the calls that `holds` picks (made on a vocoding lane) until the test opens it, so that the test
    decides what the loop does while a flow + vocoder job runs; other calls go through."""

    def __init__(self, function: Callable[..., Any], holds: Callable[..., bool] = lambda *args: True) -> None:
        self.function = function
        self.holds = holds
        self.arrived = 0  # calls held so far
        self._opened = threading.Event()

    def __call__(self, *args: Any) -> Any:
        if self.holds(*args):
            self.arrived += 1
            assert self._opened.wait(timeout=60), "the test never opened the gate"
        return self.function(*args)

    def open(self) -> None:
        self._opened.set()


def test_llm_steps_go_on_while_a_whole_sentence_is_vocoded(tts: CosyVoice, monkeypatch: pytest.MonkeyPatch) -> None:
    [short] = _segments(tts, "A whole request in the loop.", SHORT)
    [long] = _segments(tts, "A longer whole request that keeps generating.", LONG)
    [alone_short, alone_long] = [tts.decoder.decode_batch([segment])[0] for segment in (short, long)]
    gate = Gate(tts.decoder.vocode)
    monkeypatch.setattr(tts.decoder, "vocode", gate)
    scheduler = Scheduler(tts.decoder, max_live=8)
    short_sink, long_sink = Collected(), Collected()
    scheduler.submit([short], streaming=False, sink=short_sink)
    scheduler.submit([long], streaming=False, sink=long_sink)
    try:
        step_until(scheduler, lambda: gate.arrived == 1)  # the short one's tokens are all there: its job waits
        steps_before = scheduler.stats.llm_steps_while_vocoding
        _run(scheduler, steps=20)
        assert not short_sink.outputs
        assert scheduler.llm.active == 1  # the long one generated on meanwhile, one token a step
        assert scheduler.stats.llm_steps_while_vocoding == steps_before + 20
    finally:
        gate.open()
    _run(scheduler)
    np.testing.assert_allclose(short_sink.chunks[0], alone_short, atol=1e-4)
    np.testing.assert_allclose(long_sink.chunks[0], alone_long, atol=1e-4)


@pytest.mark.parametrize("max_vocode_batch", [1, 8])
def test_a_first_chunk_is_made_while_a_running_streams_chunk_is_vocoded(tts: CosyVoice, max_vocode_batch: int) -> None:
    text = "A streaming request with enough words in it for several chunks of audio, one after the other."
    [running] = _segments(tts, text, LONG)
    [late] = _segments(tts, "A late one.", SHORT)
    scheduler = Scheduler(tts.decoder, max_live=8, max_vocode_batch=max_vocode_batch)
    running_sink, late_sink = Collected(), Collected()
    scheduler.submit([running], streaming=True, sink=running_sink)
    step_until(scheduler, lambda: bool(running_sink.outputs))
    # the running stream's next chunks wait on their lane (the emit's third argument: the streams it emits)
    gate = Gate(scheduler.lanes.emit, holds=lambda streams, events, chosen: any(s.segment is running for s in chosen))
    scheduler.lanes.emit = gate
    try:
        step_until(scheduler, lambda: gate.arrived == 1)
        # a job the step that took the first chunk started before the gate was there may have made one more chunk
        held_at = len(running_sink.outputs)
        scheduler.submit([late], streaming=True, sink=late_sink)
        step_until(scheduler, lambda: late_sink.ended)  # made meanwhile, on the first-audio lane
        assert len(running_sink.outputs) == held_at and scheduler.stats.first_lane_chunks == 2
    finally:
        gate.open()
    _run(scheduler)
    for segment, collected in ((running, running_sink), (late, late_sink)):
        np.testing.assert_allclose(
            np.concatenate(collected.chunks), np.concatenate(_stream_alone(tts, segment)), atol=1e-4
        )


def test_a_stream_cancelled_while_its_chunk_is_vocoded_frees_its_slot_at_once(tts: CosyVoice) -> None:
    [segment] = _segments(tts, "A streaming request whose caller leaves mid-chunk.", LONG)
    scheduler = Scheduler(tts.decoder, max_live=1)
    gate = Gate(scheduler.lanes.emit)
    scheduler.lanes.emit = gate
    sink = Collected()
    ticket = scheduler.submit([segment], streaming=True, sink=sink)
    try:
        step_until(scheduler, lambda: gate.arrived == 1)
        scheduler.cancel(ticket)
        scheduler.step()
        assert sink.ended and scheduler.live == 0 and scheduler.llm.active == 0  # freed while the job still runs
        assert len(scheduler.streams.streams) == 1  # released once the job that works on it is over
    finally:
        gate.open()
    _run(scheduler)
    assert scheduler.streams.streams == [] and scheduler.stats.cancelled == 1


def test_flow_and_vocoder_batches_hold_at_most_max_vocode_batch_sentences(tts: CosyVoice) -> None:
    sampling = [replace(LONG, seed=seed) for seed in (1, 2, 3)]
    streamed = [_segments(tts, "Three streams take turns on the lanes.", options)[0] for options in sampling]
    [whole] = _segments(tts, "And one whole request.", SHORT)
    scheduler = Scheduler(tts.decoder, max_live=8, max_vocode_batch=1)
    sinks = [Collected() for _ in streamed]
    for segment, sink in zip(streamed, sinks, strict=True):
        scheduler.submit([segment], streaming=True, sink=sink)
    whole_sink = Collected()
    scheduler.submit([whole], streaming=False, sink=whole_sink)
    _run(scheduler)
    assert set(scheduler.stats.vocode_batch_size_counts) == {1}
    for segment, sink in zip(streamed, sinks, strict=True):
        np.testing.assert_allclose(np.concatenate(sink.chunks), np.concatenate(_stream_alone(tts, segment)), atol=1e-4)
    np.testing.assert_allclose(whole_sink.chunks[0], tts.decoder.decode_batch([whole])[0], atol=1e-4)


PARAGRAPH = " ".join(["This sentence is here to make the paragraph long enough to be split."] * 12)
PIPELINED = SamplingOptions(seed=5, min_token_text_ratio=3, max_token_text_ratio=3)


def _audio_of(tts: CosyVoice, segments: list[EncodedSegment]) -> list[np.ndarray]:
    """The request's chunks as a complete streaming submission (all its sentences at once) gives them."""
    scheduler, sink = Scheduler(tts.decoder, max_live=8), Collected()
    scheduler.submit(segments, streaming=True, sink=sink)
    _run(scheduler)
    return sink.chunks


def test_an_incomplete_request_decodes_its_first_sentence_before_the_others_come(tts: CosyVoice) -> None:
    segments = _segments(tts, PARAGRAPH, PIPELINED)
    assert len(segments) == 3
    scheduler = Scheduler(tts.decoder, max_live=8)
    sink = Collected()
    ticket = scheduler.submit(segments[:1], streaming=True, sink=sink, complete=False)
    step_until(scheduler, lambda: bool(sink.outputs))  # first audio, the others not encoded yet
    scheduler.extend(ticket, segments[1:2], final=False)  # in time: generated while the first is vocoded
    step_until(scheduler, lambda: not scheduler.has_work)
    # Both sentences done, the last not there: the request waits, holding no slot, and the loop is idle.
    assert not sink.ended and scheduler.live == 0 and scheduler.queued == 0 and scheduler.awaiting_sentences == 1
    scheduler.extend(ticket, segments[2:], final=True)
    _run(scheduler)
    assert sink.ended and scheduler.awaiting_sentences == 0 and not scheduler.has_work
    assert scheduler.stats.pipelined_sentences >= 1  # the second came while the first was still decoding
    expected = _audio_of(tts, segments)
    assert [len(c) for c in sink.chunks] == [len(c) for c in expected]
    np.testing.assert_allclose(np.concatenate(sink.chunks), np.concatenate(expected), atol=1e-4)


def test_an_incomplete_request_whose_last_word_adds_nothing_ends_then(tts: CosyVoice) -> None:
    [segment] = _segments(tts, "Short.", SHORT)
    scheduler = Scheduler(tts.decoder, max_live=8)
    sink = Collected()
    ticket = scheduler.submit([segment], streaming=False, sink=sink, complete=False)
    _run(scheduler)
    assert len(sink.outputs) == 1 and not sink.ended  # its one sentence's audio, and it waits
    scheduler.extend(ticket, [], final=True)
    scheduler.step()
    assert sink.ended and scheduler.awaiting_sentences == 0


@pytest.mark.parametrize("while_decoding", [False, True])
def test_cancelling_a_request_waiting_for_its_later_sentences_ends_it(tts: CosyVoice, while_decoding: bool) -> None:
    segments = _segments(tts, PARAGRAPH, PIPELINED)
    scheduler = Scheduler(tts.decoder, max_live=1)
    sink = Collected()
    ticket = scheduler.submit(segments[:1], streaming=True, sink=sink, complete=False)
    step_until(scheduler, lambda: bool(sink.outputs) if while_decoding else not scheduler.has_work)
    scheduler.cancel(ticket)
    assert scheduler.has_work  # even an idle loop steps to end it
    scheduler.step()
    assert sink.ended and scheduler.stats.cancelled == 1
    assert scheduler.live == 0 and scheduler.llm.active == 0 and scheduler.awaiting_sentences == 0
    scheduler.extend(ticket, segments[1:], final=True)  # the encoder's answer, after the caller left: dropped
    _run(scheduler)
    assert scheduler.stats.admitted == 1 and not scheduler.has_work
    waiting = Collected()  # the slot is free
    scheduler.submit(segments[:1], streaming=True, sink=waiting)
    _run(scheduler)
    assert waiting.ended


def test_a_refused_later_sentence_ends_its_request_with_the_refusal(tts: CosyVoice) -> None:
    [short] = _segments(tts, "Short.", SHORT)
    [long] = _segments(tts, "A far longer sentence, with many more words in it than the short one.", LONG)
    probe = Scheduler(tts.decoder, max_live=8)
    scheduler = Scheduler(tts.decoder, max_live=8, memory_budget_bytes=probe.limits.memory_estimate(long) - 1)
    sink = Collected()
    ticket = scheduler.submit([short], streaming=True, sink=sink, complete=False)
    scheduler.step()
    with pytest.raises(RequestTooLargeError, match="budget"):
        scheduler.extend(ticket, [long], final=True)
    assert scheduler.queued == 0  # refused whole: nothing of it was queued
    scheduler.abort(ticket, RequestTooLargeError("the later sentence was refused"))
    scheduler.step()
    assert isinstance(sink.outputs[-2], RequestTooLargeError) and sink.ended
    assert scheduler.live == 0 and scheduler.llm.active == 0 and scheduler.awaiting_sentences == 0
    assert not scheduler.has_work


def test_an_idle_loop_ends_a_request_whose_later_sentences_come_too_late(tts: CosyVoice) -> None:
    [segment] = _segments(tts, "Short.", SHORT)
    scheduler = Scheduler(tts.decoder, max_live=8, max_request_s=600)
    sink = Collected()
    ticket = scheduler.submit([segment], streaming=True, sink=sink, complete=False)
    _run(scheduler)
    assert sink.outputs and not sink.ended and not scheduler.has_work
    ticket.expires_at = time.monotonic() + 0.5  # as if `max_request_s` were nearly over
    loop = threading.Thread(target=scheduler.run, args=(lambda busy: None, lambda exc: CosyVoiceError("failed")))
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while not sink.ended and time.monotonic() < deadline:  # the sleeping loop wakes up at the deadline itself
            time.sleep(0.05)
        assert isinstance(sink.outputs[-2], DecodeLimitError) and sink.ended
        assert scheduler.awaiting_sentences == 0 and scheduler.stats.over_limit == 1
    finally:
        scheduler.fail(RuntimeError("test over"), CosyVoiceError("test over"))
        scheduler.cancel(ticket)  # wakes the loop, which sees the failure and returns
        loop.join(timeout=30)
