"""The decoder loop's playback-deadline policy (engine.runtime.playback, engine.runtime.scheduler) on the tiny
models, driven by a fake clock: who is admitted first, preemption with equal audio, no starvation, fcfs kept,
underruns counted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from engine.errors import CosyVoiceError
from engine.llm.sampling import SamplingOptions
from engine.runtime.pipeline import CosyVoice
from engine.runtime.playback import DeadlinePolicy, FcfsPolicy, PlaybackClock
from engine.runtime.scheduler import Scheduler, Ticket
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import SynthesisRequest
from tests.engine.conftest import Collected, step_until

TWO_SENTENCES = "This is a much longer request that keeps the decoder busy for a while. " * 8
LONG_SENTENCE = "This is a much longer request that keeps the decoder busy for a while."


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tiny() -> CosyVoice:
    return CosyVoice.load("tiny")


def _segments(tts: CosyVoice, text: str, seed: int, ratio: float) -> list[EncodedSegment]:
    """Sentences that speak exactly `ratio` tokens per text token (every stop id masked until then)."""
    sampling = SamplingOptions(
        seed=seed, min_token_text_ratio=ratio, max_token_text_ratio=ratio, mask_all_stop_ids_before_min_len=True
    )
    return tts.encoder.encode(SynthesisRequest(text, tts.voices[0], sampling=sampling))


def _run(scheduler: Scheduler) -> None:
    step_until(scheduler, lambda: not scheduler.has_work, limit=3000)


def _admission_order(scheduler: Scheduler, tickets: dict[str, Ticket]) -> list[str]:
    """Run to the end, noting which request's sentence was admitted at each step."""
    order: list[str] = []
    admitted = {name: t.admitted for name, t in tickets.items()}
    while scheduler.has_work:
        scheduler.step()
        for name, ticket in tickets.items():
            order += [name] * (ticket.admitted - admitted[name])
            admitted[name] = ticket.admitted
    return order


def _stream_with_audio_and_its_next_sentence_waiting(
    tts: CosyVoice, policy: DeadlinePolicy | FcfsPolicy, clock: FakeClock
) -> tuple[Scheduler, Ticket]:
    """A two-sentence stream on a one-slot loop, its first sentence's tokens all made and some audio handed on."""
    scheduler = Scheduler(tts.decoder, max_live=1, policy=policy, clock=clock)
    segments = _segments(tts, TWO_SENTENCES, 1, 4.0)
    assert len(segments) == 2
    stream = scheduler.submit(segments, streaming=True, sink=Collected())
    step_until(
        scheduler, lambda: stream.sentences[0].tokens_done and stream.playback.first_audio_at is not None, limit=3000
    )
    return scheduler, stream


ORDERS = [(DeadlinePolicy(), ["new", "stream"]), (FcfsPolicy(), ["stream", "new"])]


@pytest.mark.parametrize(("policy", "expected"), ORDERS)
def test_a_new_request_goes_before_a_stream_with_slack_but_fcfs_keeps_the_running_one_first(
    tiny: CosyVoice, policy: DeadlinePolicy | FcfsPolicy, expected: list[str]
) -> None:
    clock = FakeClock()  # frozen: the stream's listener is as far ahead as all its audio
    scheduler, stream = _stream_with_audio_and_its_next_sentence_waiting(tiny, policy, clock)
    assert stream.playback.audio_s > policy_deadline_gap(policy)
    new = scheduler.submit(_segments(tiny, "Hi there.", 2, 4.0), streaming=True, sink=Collected())
    assert _admission_order(scheduler, {"stream": stream, "new": new}) == expected


def policy_deadline_gap(policy: DeadlinePolicy | FcfsPolicy) -> float:
    return policy.target_first_audio_s if isinstance(policy, DeadlinePolicy) else 0.0


def test_a_stream_whose_listener_runs_out_first_goes_before_a_new_request(tiny: CosyVoice) -> None:
    clock = FakeClock()
    # the newcomer may wait long for its first audio: the stream's listener runs out well before that
    policy = DeadlinePolicy(target_first_audio_s=1000.0)
    scheduler, stream = _stream_with_audio_and_its_next_sentence_waiting(tiny, policy, clock)
    new = scheduler.submit(_segments(tiny, "Hi there.", 2, 4.0), streaming=True, sink=Collected())
    assert _admission_order(scheduler, {"stream": stream, "new": new}) == ["stream", "new"]


MODELS = ("tiny", "cosyvoice2-tiny", "cosyvoice3-tiny")


def _audio_until(scheduler: Scheduler, ticket: Ticket, sink: Collected, seconds: float) -> np.ndarray:
    """Step until `ticket` has handed on `seconds` of audio, then cancel it and run the loop dry -> that audio."""
    step_until(scheduler, lambda: ticket.playback.audio_s >= seconds, limit=3000)
    scheduler.cancel(ticket)
    _run(scheduler)
    return np.concatenate([chunk for chunk in sink.outputs if isinstance(chunk, np.ndarray) and chunk.size])


@pytest.mark.slow
@pytest.mark.parametrize("keep_cache", [True, False], ids=["kv-kept", "recomputed"])
@pytest.mark.parametrize("model", MODELS)
def test_a_preempted_stream_resumes_with_the_audio_it_has_unpreempted(model: str, keep_cache: bool) -> None:
    tts = CosyVoice.load(model)
    text = "A long stream that is far ahead of its listener."
    [probe_segment] = _segments(tts, text, 1, 1.0)
    [long] = _segments(tts, text, 1, 1000 / probe_segment.text_len)  # 1000 tokens: 20 s (v1) or 40 s of speech
    [short] = _segments(tts, "Hi there.", 2, 4.0)
    clock = FakeClock()  # frozen: the long stream's slack grows with every chunk
    probe = Scheduler(tts.decoder, max_live=1)
    budget = None if keep_cache else probe.limits.memory_estimate(long) + probe.limits.memory_estimate(short) - 1
    scheduler = Scheduler(tts.decoder, max_live=1, memory_budget_bytes=budget, clock=clock)
    preempted, newcomer = Collected(), Collected()
    ticket = scheduler.submit([long], streaming=True, sink=preempted)
    step_until(scheduler, lambda: ticket.playback.audio_s > 3.5, limit=3000)  # its deadline 2.5 s past the newcomer's
    assert not ticket.sentences[0].tokens_done
    scheduler.submit([short], streaming=True, sink=newcomer)
    scheduler.step()
    assert scheduler.stats.preempted == 1 and ticket.sentences[0].cache_kept is keep_cache
    # The audio of the tokens made before the pause, and of the next 100 made after it, is enough: the stream runs
    # on unchanged from there (its whole 20-40 s took a v2 test 30 s).
    config = tts.decoder.model.config
    compared_s = (ticket.speech_tokens + 100) / config.speech_token_rate
    audio = _audio_until(scheduler, ticket, preempted, compared_s)
    assert scheduler.stats.resumed == 1 and newcomer.ended

    alone = Scheduler(tts.decoder, max_live=1)
    alone_sink = Collected()
    alone_audio = _audio_until(alone, alone.submit([long], streaming=True, sink=alone_sink), alone_sink, compared_s)
    samples = round(compared_s * config.sample_rate)
    assert min(len(audio), len(alone_audio)) >= samples
    np.testing.assert_allclose(audio[:samples], alone_audio[:samples], atol=1e-4)


@pytest.mark.slow
def test_no_request_starves_under_a_stream_of_arrivals(tiny: CosyVoice) -> None:
    clock = FakeClock()
    scheduler = Scheduler(tiny.decoder, max_live=2, policy=DeadlinePolicy(), clock=clock)
    sinks: list[Collected] = []
    texts = [TWO_SENTENCES, "Hi.", "A whole sentence of middling length.", "Hello there."]
    for step in range(400):
        clock.now += 0.05
        if step % 10 == 0 and len(sinks) < 24:
            sink = Collected()
            index = len(sinks)
            segments = _segments(tiny, texts[index % len(texts)], index, 3.0)
            scheduler.submit(segments, streaming=index % 3 != 2, sink=sink)
            sinks.append(sink)
        scheduler.step()
    _run(scheduler)
    assert len(sinks) == 24 and all(sink.ended and sink.audio.size for sink in sinks)
    assert scheduler.stats.preempted > 0  # the policy did pause streams for newcomers


def test_an_underrun_is_counted_and_reported_at_the_end(tiny: CosyVoice) -> None:
    clock = FakeClock()
    ended: list[tuple[Ticket, CosyVoiceError | None]] = []
    scheduler = Scheduler(tiny.decoder, max_live=1, clock=clock, on_request_end=lambda t, e: ended.append((t, e)))
    [segment] = _segments(tiny, "A stream whose listener outruns the decoder.", 1, 30.0)
    ticket = scheduler.submit([segment], streaming=True, sink=Collected())
    step_until(scheduler, lambda: ticket.playback.first_audio_at is not None, limit=3000)
    delivered = ticket.playback.audio_s
    clock.now += delivered + 5.0  # the listener played everything and waited 5 s more
    _run(scheduler)
    playback = ticket.playback
    assert playback.underruns >= 1 and playback.min_slack_s < -4.0
    assert ended == [(ticket, None)] and playback.first_audio_s == 0.0


def test_the_playback_clock() -> None:
    clock = PlaybackClock(arrived_at=10.0, estimated_audio_s=3.0)
    assert clock.slack(10.5) == math.inf and clock.first_audio_s is None
    clock.deliver(2.0, now=10.5)  # first audio half a second after arrival
    assert clock.first_audio_s == 0.5 and clock.slack(11.0) == 1.5
    clock.deliver(1.0, now=12.0)  # 0.5 s to spare
    clock.deliver(1.0, now=14.0)  # due at 13.5: an underrun
    assert clock.underruns == 1 and clock.min_slack_s == -0.5 and clock.audio_s == 4.0
    policy = DeadlinePolicy(target_first_audio_s=1.0)

    class Request:
        def __init__(self, streaming: bool, playback: PlaybackClock) -> None:
            self.streaming, self.playback = streaming, playback

    assert policy.deadline(Request(True, clock)) == 10.5 + 4.0  # its listener runs out then
    assert policy.deadline(Request(True, PlaybackClock(10.0, 3.0))) == 11.0  # first audio due
    assert policy.deadline(Request(False, PlaybackClock(10.0, 3.0))) == 16.0  # whole: 2 x its estimated 3 s
    with pytest.raises(ValueError, match="target_first_audio_s"):
        DeadlinePolicy(target_first_audio_s=math.nan)


HOLDS = [
    (DeadlinePolicy(), False, False),
    (DeadlinePolicy(first_audio_hold_s=0.0), False, True),
    (DeadlinePolicy(), True, True),
    (FcfsPolicy(), False, True),
]


@pytest.mark.parametrize(
    ("policy", "near_its_deadline", "started"), HOLDS, ids=["deadline-holds", "hold-off", "deadline-due", "fcfs"]
)
def test_work_with_time_to_spare_leaves_the_lanes_to_a_first_audio(
    policy: DeadlinePolicy | FcfsPolicy, near_its_deadline: bool, started: bool
) -> None:
    """A whole request whose tokens are all made while a stream waits for its first audio gets no flow + vocoder job
    until that audio comes, if its deadline is more than `first_audio_hold_s` away; it does when its deadline is
    near, without the hold, and under fcfs. (Its LLM row generates on, as on a GPU: the lanes alone are tested.)"""
    tts = CosyVoice.load("cosyvoice2-tiny")  # a stream's first chunk needs 28 tokens: the whole one has 12 before
    clock = FakeClock()
    scheduler = Scheduler(tts.decoder, max_live=2, policy=policy, clock=clock, hold_rows=False)
    stream = scheduler.submit(_segments(tts, "Hi there, a newcomer.", 2, 8.0), streaming=True, sink=Collected())
    [whole_segment] = _segments(tts, "A whole sentence.", 1, 1.0)
    [whole_segment] = _segments(tts, "A whole sentence.", 1, 12 / whole_segment.text_len)
    whole = scheduler.submit([whole_segment], streaming=False, sink=Collected())
    deadline = DeadlinePolicy().deadline
    assert deadline(whole) > deadline(stream) + 1.0  # 2 x its estimated audio against 1 s
    if near_its_deadline:
        clock.now = deadline(whole) - 0.5
    sentence = whole.sentences[0]
    seen_in_job = False
    for _ in range(3000):
        if stream.playback.first_audio_at is not None:
            break
        scheduler.step()
        seen_in_job |= sentence.in_job
    assert stream.playback.first_audio_at is not None and sentence.tokens_done
    assert seen_in_job is started
    _run(scheduler)  # the held work is done once the first audio came
    assert whole.ended and stream.ended and whole.playback.audio_s > 0


@pytest.mark.parametrize("hold_rows", [True, False], ids=["held", "not-held"])
def test_rows_with_time_to_spare_sit_out_the_llm_steps_of_a_first_audio_with_their_audio_unchanged(
    tiny: CosyVoice, hold_rows: bool
) -> None:
    """On CPU (`hold_rows`) a generating whole request whose deadline is far makes no token while a newcomer stream
    generates toward its first audio; it resumes after (its KV cache kept) and ends with the audio it has alone."""
    [whole_segment] = _segments(tiny, "A whole sentence of middling length.", 1, 20.0)
    [stream_segment] = _segments(tiny, "Hi there, a newcomer.", 2, 8.0)
    alone = Collected()
    by_itself = Scheduler(tiny.decoder, max_live=1)
    by_itself.submit([whole_segment], streaming=False, sink=alone)
    _run(by_itself)

    clock = FakeClock()
    scheduler = Scheduler(tiny.decoder, max_live=2, clock=clock, hold_rows=hold_rows)
    whole_sink = Collected()
    whole = scheduler.submit([whole_segment], streaming=False, sink=whole_sink)
    tokens = whole.sentences[0].tokens
    step_until(scheduler, lambda: len(tokens) >= 10, limit=100)
    stream = scheduler.submit([stream_segment], streaming=True, sink=Collected())
    step_until(scheduler, lambda: stream.speech_tokens > 0, limit=100)
    made_before = len(tokens)
    step_until(scheduler, lambda: stream.sentences[0].tokens_done, limit=3000)
    assert stream.playback.first_audio_at is None  # its one chunk is made once all its tokens are there
    assert (len(tokens) == made_before) is hold_rows
    assert (scheduler.stats.held_for_first_audio == 1) is hold_rows
    _run(scheduler)
    assert stream.ended and whole_sink.audio.shape == alone.audio.shape
    np.testing.assert_allclose(whole_sink.audio, alone.audio, atol=1e-4)


def test_the_first_audio_order_puts_the_shortest_first_chunk_first_until_one_is_passed_over_too_long() -> None:
    long = Ticket(sentences=[], streaming=True, sink=print, playback=PlaybackClock(0.0, 9.6, 2.4), expires_at=math.inf)
    short = Ticket(sentences=[], streaming=True, sink=print, playback=PlaybackClock(1.0, 0.9, 0.9), expires_at=math.inf)

    def first(policy: DeadlinePolicy | FcfsPolicy, now: float) -> Ticket:
        return min([long, short], key=lambda request: policy.first_audio_key(request, now))

    assert first(DeadlinePolicy(), now=1.2) is short  # the long one is 0.2 s past its deadline: passed over
    assert first(DeadlinePolicy(), now=2.0) is long  # 1 s past it: its turn
    assert first(DeadlinePolicy(first_audio_passover_s=3.0), now=3.9) is short
    assert first(DeadlinePolicy(first_audio_passover_s=0.0), now=1.0) is long  # due: earliest deadline first
    assert first(FcfsPolicy(), now=1.2) is long


FIRST_AUDIO_ORDERS = [
    (DeadlinePolicy(), 1.0, {"short", "long-1"}),
    (DeadlinePolicy(), 2.0, {"long-1", "long-2"}),  # the long ones are 1 s past their deadline: first
    (DeadlinePolicy(first_audio_passover_s=0.0), 1.0, {"long-1", "long-2"}),
    (FcfsPolicy(), 1.0, {"long-1", "long-2"}),
]


@pytest.mark.parametrize(
    ("policy", "short_arrives_at", "first_jobs"),
    FIRST_AUDIO_ORDERS,
    ids=["shortest-first", "passed-over-too-long", "passover-off", "fcfs"],
)
def test_a_short_first_chunk_is_made_before_long_ones_that_came_earlier(
    tiny: CosyVoice, policy: DeadlinePolicy | FcfsPolicy, short_arrives_at: float, first_jobs: set[str]
) -> None:
    """Two long streams and, later, a short one all have their first chunk ready at the same step (120 tokens: a
    long sentence's first chunk, the short one's whole sentence); the two lanes take two of them, by the policy's
    first-audio order."""
    clock = FakeClock()
    scheduler = Scheduler(tiny.decoder, max_live=3, policy=policy, clock=clock)
    tickets = {
        name: scheduler.submit(_segments(tiny, LONG_SENTENCE, seed, 10.0), streaming=True, sink=Collected())
        for seed, name in enumerate(["long-1", "long-2"])
    }
    clock.now = short_arrives_at
    tickets["short"] = scheduler.submit(_segments(tiny, "Hi there.", 3, 40.0), streaming=True, sink=Collected())
    sentences = {name: ticket.sentences[0] for name, ticket in tickets.items()}
    step_until(scheduler, lambda: any(s.in_job for s in sentences.values()), limit=300)
    assert {name for name, sentence in sentences.items() if sentence.in_job} == first_jobs
    _run(scheduler)
    assert all(ticket.ended and ticket.playback.audio_s > 0 for ticket in tickets.values())


@dataclass(frozen=True)
class _AuditedDeadlines(DeadlinePolicy):
    """Notes, at every deadline the loop asks for, whether the request had audio made but not yet handed on."""

    seen: list[bool] = field(default_factory=list)

    def deadline(self, request: Ticket) -> float:
        pending = request.emitted < len(request.sentences) and bool(request.sentences[request.emitted].outputs)
        self.seen.append(pending)
        return super().deadline(request)


def test_the_audio_made_is_handed_on_before_any_deadline_is_read(tiny: CosyVoice) -> None:
    """A request's deadline moves when its audio is handed on (its listener has more to play): the loop hands on
    what its finished jobs made before it admits or chooses work, so it never orders by a stale deadline."""
    policy = _AuditedDeadlines()
    scheduler = Scheduler(tiny.decoder, max_live=2, policy=policy, clock=FakeClock())
    sinks = [Collected() for _ in range(3)]
    for seed, sink in enumerate(sinks):
        scheduler.submit(_segments(tiny, TWO_SENTENCES, seed, 10.0), streaming=True, sink=sink)
    _run(scheduler)
    assert all(sink.ended and sink.audio.size for sink in sinks)
    assert len(policy.seen) > 100 and not any(policy.seen)
