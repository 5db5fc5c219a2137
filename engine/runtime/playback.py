"""When each request needs its next audio: the playback clock of a request and the decoder loop's orders.

A streaming request's listener is modelled as playing its audio at 1x from its first chunk on: its *slack* is the
audio handed on so far minus the wall time since its first chunk, and a chunk handed on at negative slack is an
*underrun*. Every request has a *deadline*, the time by which it needs its next audio: a stream with no audio yet,
its arrival + `target_first_audio_s`; a stream with audio, the moment its listener runs out; a whole request, its
arrival + `WHOLE_DEADLINE_FACTOR` x its estimated audio length.

`DeadlinePolicy` admits sentences and hands lane work earliest deadline first, pauses a sentence with slack to spare
for an earlier deadline, holds far-off work while a stream waits for its first audio (`may_hold`), and among first
audios takes the shortest first chunk first until one is `first_audio_passover_s` past due; deadlines move only when
audio is handed on, so nothing starves. `FcfsPolicy` keeps the first-come order. Why and how:
docs/scheduler.md, "Order: playback deadlines".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

# Speech per target text token, to estimate a whole request's audio before it is generated: about 0.3 s for English
# BPE tokens (0.75 words each at 2.5 words per second) and for Chinese characters alike.
SECONDS_PER_TEXT_TOKEN = 0.3


@dataclass
class PlaybackClock:
    """One request's listener, who plays its audio at 1x from its first chunk on. Times are `clock()` seconds."""

    arrived_at: float
    estimated_audio_s: float  # before any audio: from the text's length
    first_chunk_s: float = 0.0  # a stream's estimated first chunk: its first sentence, at most the model's first chunk
    first_audio_at: float | None = None
    audio_s: float = 0.0  # handed on so far
    underruns: int = 0  # chunks handed on after the listener had run out
    min_slack_s: float = math.inf  # the least slack seen when a chunk was handed on (after the first)

    def deliver(self, seconds: float, now: float) -> None:
        """A chunk of `seconds` of audio was handed on at `now`."""
        if self.first_audio_at is None:
            self.first_audio_at = now
        else:
            slack = self.slack(now)
            self.min_slack_s = min(self.min_slack_s, slack)
            self.underruns += slack < 0
        self.audio_s += seconds

    def slack(self, now: float) -> float:
        """Seconds of audio the listener still has to play at `now` (negative: it ran out); inf before any audio."""
        if self.first_audio_at is None:
            return math.inf
        return self.first_audio_at + self.audio_s - now

    @property
    def first_audio_s(self) -> float | None:
        """Time to first audio, from arrival."""
        return None if self.first_audio_at is None else self.first_audio_at - self.arrived_at


class Request(Protocol):
    """What a policy reads of a request (engine.runtime.scheduler.Ticket)."""

    streaming: bool
    playback: PlaybackClock


class SchedulingPolicy(Protocol):
    name: str
    by_deadline: bool  # the lanes take work earliest deadline first (else in today's first-come order)

    def deadline(self, request: Request) -> float: ...

    def admission_key(self, request: Request, continues: bool) -> tuple[float, ...]:
        """Sort key of a request's next sentence for admission (smallest first); `continues`: the request runs."""
        ...

    def may_preempt(self, running: Request, waiting: Request, now: float) -> bool:
        """Whether `running`'s generating sentence may be paused to give its slot to `waiting`'s."""
        ...

    def may_hold(self, request: Request, now: float) -> bool:
        """Whether `request`'s ready flow + vocoder work may wait while a stream waits for its first audio."""
        ...

    def first_audio_key(self, request: Request, now: float) -> tuple[float, ...]:
        """Sort key of a stream's ready work while it waits for its first audio, among such streams (smallest first)."""
        ...


# A whole request is answered at once, so its deadline is looser than a stream's: its arrival + this x its estimated
# audio length ranks it behind streams due sooner without starving it (the value since deadline scheduling came; no
# measurement tuned it).
WHOLE_DEADLINE_FACTOR = 2.0


@dataclass(frozen=True)
class DeadlinePolicy:
    """Earliest deadline first (see the module docstring), with preemption."""

    target_first_audio_s: float = 1.0
    # The next three are tuned, not configured (docs/performance.md, the late short stream on 2 CPU cores); the tests
    # vary them to show what each does.
    # A sentence is paused only if its request can wait this long and its deadline is at least this much later
    # than the one that takes its slot (so two requests never trade a slot back and forth); 2 s was lowered to 1 s
    # in runs 6-12, where a stream a second ahead of its listener held a slot a first audio waited for.
    min_preempt_slack_s: float = 1.0
    # While a stream waits for its first audio, work whose deadline is further off than this waits (0: never); the
    # measured best (runs 6-12: the late short stream's median time to first audio 0.40 s at 1 s, 0.56 s without a
    # hold, 0.50 s at 2 s).
    first_audio_hold_s: float = 1.0
    # A first audio may be passed over by shorter first chunks until it is this far past its deadline; 0.5 s made no
    # difference beyond noise (runs 30-31).
    first_audio_passover_s: float = 1.0
    name: Literal["deadline"] = field(default="deadline", init=False)
    by_deadline: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        for name in (
            "target_first_audio_s",
            "min_preempt_slack_s",
            "first_audio_hold_s",
            "first_audio_passover_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def deadline(self, request: Request) -> float:
        clock = request.playback
        if not request.streaming:
            return clock.arrived_at + WHOLE_DEADLINE_FACTOR * clock.estimated_audio_s
        if clock.first_audio_at is None:
            return clock.arrived_at + self.target_first_audio_s
        return clock.first_audio_at + clock.audio_s

    def admission_key(self, request: Request, continues: bool) -> tuple[float, ...]:
        return (self.deadline(request),)

    def may_preempt(self, running: Request, waiting: Request, now: float) -> bool:
        later = self.deadline(running)
        return later - now >= self.min_preempt_slack_s and later - self.deadline(waiting) >= self.min_preempt_slack_s

    def may_hold(self, request: Request, now: float) -> bool:
        waits_for_first_audio = request.streaming and request.playback.first_audio_at is None
        return (
            self.first_audio_hold_s > 0
            and not waits_for_first_audio
            and self.deadline(request) - now > self.first_audio_hold_s
        )

    def first_audio_key(self, request: Request, now: float) -> tuple[float, ...]:
        deadline = self.deadline(request)
        if now - deadline >= self.first_audio_passover_s:  # passed over long enough: by its deadline, before the rest
            return (0.0, deadline)
        return (1.0, request.playback.first_chunk_s, deadline)


@dataclass(frozen=True)
class FcfsPolicy:
    """First come, first served: a running request's next sentence first, then the oldest new request; no pause."""

    name: Literal["fcfs"] = field(default="fcfs", init=False)
    by_deadline: bool = field(default=False, init=False)

    def deadline(self, request: Request) -> float:
        return request.playback.arrived_at

    def admission_key(self, request: Request, continues: bool) -> tuple[float, ...]:
        return (0.0 if continues else 1.0, request.playback.arrived_at)

    def may_preempt(self, running: Request, waiting: Request, now: float) -> bool:
        return False

    def may_hold(self, request: Request, now: float) -> bool:
        return False

    def first_audio_key(self, request: Request, now: float) -> tuple[float, ...]:
        return (request.playback.arrived_at,)
