"""Ray Serve autoscaling policies for the decoder: utilization hysteresis, queue-driven bursts, schedules.

Serve calls a policy on the controller about every 0.1 s with an `AutoscalingContext` and then post-processes the
returned count (scaling factors, delays, clipping to `min_replicas`/`max_replicas`). The policies keep their own
windows in `policy_state`, so the recommended configs set Serve's delays to 0; and because Serve clips
to `min_replicas` last, that must be the lowest floor of any schedule window while the policy raises the floor per
window.

Rules (`ScalingRules`, through `policy_kwargs`): +1 replica when the time-weighted mean utilization over
`scale_up_window_s` is above `scale_up_utilization`; -1 when the mean over
`scale_down_window_s` is below `scale_down_utilization` and nothing waits; at once, proportionally, when the queue per
replica exceeds `target_queue_per_replica` (at most `QUEUE_SCALE_UP_FACTOR` x per step); clipped to the active
schedule window. After any change of the target both windows restart, so the next utilization step waits a whole
window. `WakeRule`: where the floor is 0 and a CPU fallback carries the work, the fallback's waits wake the
GPU decoder through a `WakeBoard` in Ray's internal KV. Why each rule: docs/autoscaling.md, "How the policy works".
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from autoscaling.metrics import FIRST_AUDIO_WAIT_S, QUEUE_DEPTH, UTILIZATION
from autoscaling.schedule import Schedule, ScheduleWindow
from observability.metrics import AutoscalingMetrics

logger = logging.getLogger("ray.serve")

# Keys of this policy's memory inside `policy_state` (Serve keeps its own `__decision_*` keys there too).
STATE_WINDOW_SINCE = "cosyvoice_window_since"
STATE_LAST_TICK = "cosyvoice_last_tick"
STATE_UTILIZATION_BUCKETS = "cosyvoice_utilization_buckets"
STATE_LAST_TARGET = "cosyvoice_last_target"

DECODER_POLICY_PATH = "autoscaling.policy:DecoderAutoscalingPolicy"
CPU_FALLBACK_POLICY_PATH = "autoscaling.policy:CpuFallbackAutoscalingPolicy"

DEFAULT_SCHEDULE = Schedule(
    timezone="UTC",
    windows=(
        ScheduleWindow(name="peak", start="09:00", end="21:00", min_replicas=2),
        ScheduleWindow(name="night", start="02:00", end="06:00", min_replicas=0),
    ),
)


# The queue rule's step, at most this x the running replicas: a queue built while replicas start does not jump to
# max_replicas (docs/autoscaling.md, "How the policy works").
QUEUE_SCALE_UP_FACTOR = 2.0


class ScalingRules(BaseModel):
    """Thresholds, windows and bounds of the decoder policy (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Rules these had and no longer have: name -> why; a config that still sets one is refused with that message.
    REMOVED_RULES: ClassVar[Mapping[str, str]] = {
        "queue_scale_up_factor": f"fixed at {QUEUE_SCALE_UP_FACTOR:g} (autoscaling.policy.QUEUE_SCALE_UP_FACTOR): "
        "a queue built while replicas start does not jump to max_replicas",
        "scale_up_cooldown_s": "after any change of the target the windows restart, so a +1 waits a whole "
        "scale_up_window_s (300 s) anyway: the 180 s cooldown, shorter, never held a step back",
        "scale_down_cooldown_s": "after any change of the target the windows restart, so a -1 waits a whole "
        "scale_down_window_s (1200 s) anyway: the 600 s cooldown, shorter, never held a step back",
    }

    min_replicas: int = Field(1, ge=0, description="the floor outside the schedule's windows")
    max_replicas: int = Field(
        12,
        ge=0,
        description="the ceiling outside the windows (the evening peak at the cited GPU rate needs 12: "
        "docs/autoscaling.md)",
    )
    scale_up_utilization: float = Field(
        0.70, description="+1 replica when the replicas' mean utilization over `scale_up_window_s` is above this"
    )
    scale_up_window_s: float = Field(300.0, ge=0, description="the window scale_up_utilization is judged over")
    scale_down_utilization: float = Field(
        0.30, description="-1 when that mean over `scale_down_window_s` is below this and nothing waits"
    )
    scale_down_window_s: float = Field(1200.0, ge=0, description="the window scale_down_utilization is judged over")
    target_queue_per_replica: float = Field(
        4.0,
        gt=0,
        description="at once, without a window: waiting requests per replica above this scale up to "
        "ceil(waiting / this), at most 2 x the running replicas per step (QUEUE_SCALE_UP_FACTOR)",
    )
    schedule: Schedule = Field(
        DEFAULT_SCHEDULE, description="time-of-day windows with their own bounds (default: a peak at 2, a night at 0)"
    )

    @model_validator(mode="before")
    @classmethod
    def _removed_rules(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            removed = [f"{name} was removed: {why}" for name, why in cls.REMOVED_RULES.items() if name in data]
            if removed:
                raise ValueError("; ".join(removed))
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ScalingRules:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if not 0 <= self.scale_down_utilization < self.scale_up_utilization <= 1:
            raise ValueError("need 0 <= scale_down_utilization < scale_up_utilization <= 1")
        return self

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> ScalingRules:
        """Build from JSON-style `policy_kwargs` (the schedule as a dict, see `Schedule.from_dict`)."""
        values = dict(kwargs)
        unknown = set(values) - set(cls.model_fields) - set(cls.REMOVED_RULES)  # those: refused with their reason
        if unknown:
            raise ValueError(f"unknown scaling rule(s): {sorted(unknown)}")
        if "schedule" in values:
            values["schedule"] = values["schedule"] or {}
        return cls.model_validate(values)

    def to_kwargs(self) -> dict[str, Any]:
        """JSON-serializable kwargs that `from_kwargs` turns back into these rules."""
        return self.model_dump(mode="json")

    @property
    def bucket_s(self) -> float:
        """Width of the buckets the utilization history is kept in: 1/30 of the shorter window."""
        return max(0.05, min(self.scale_up_window_s, self.scale_down_window_s) / 30.0)

    def bounds_at(self, timestamp: float) -> tuple[int, int]:
        return self.schedule.bounds_at(timestamp, self.min_replicas, self.max_replicas)

    def lowest_floor(self) -> int:
        """The smallest min over the day: the deployment's Serve `min_replicas` must not exceed it."""
        window_floors = [w.min_replicas for w in self.schedule.windows if w.min_replicas is not None]
        return min([self.min_replicas, *window_floors])

    def highest_ceiling(self) -> int:
        window_ceilings = [w.max_replicas for w in self.schedule.windows if w.max_replicas is not None]
        return max([self.max_replicas, *window_ceilings])


# How long a wake holds the GPU decoder's floor at 1 after the load last passed the rule: ten times the GPU replica's
# 90 s start, so a wake is not undone by a lull (the simulator gives the same figures at 300 s or 1800 s:
# docs/autoscaling.md).
WAKE_HOLD_S = 900.0


@dataclass(frozen=True)
class WakeRule:
    """When load at the CPU fallback wakes a GPU decoder replica inside a 0-floor window (module docstring):
    a fallback replica's `first_audio_wait_s` above `wait_s`, or at least `queued` requests queued at the
    fallback's handles (every replica at its `max_ongoing_requests`: their wait is not reported yet). The app's
    rule waits the first-audio SLO and holds `WAKE_HOLD_S`; the tests and the simulator pass their own."""

    wait_s: float
    hold_s: float = WAKE_HOLD_S
    queued: float = 1.0

    def __post_init__(self) -> None:
        if self.wait_s < 0 or self.hold_s < 0 or self.queued <= 0:
            raise ValueError(f"need wake wait_s >= 0, hold_s >= 0 and queued > 0, got {self}")

    def fires(self, ctx: Any) -> bool:
        """Whether the fallback deployment's context shows load past the rule."""
        return first_audio_wait_s(ctx) > self.wait_s or (ctx.total_queued_requests or 0.0) >= self.queued

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None) -> WakeRule | None:
        return None if kwargs is None else cls(**kwargs)

    def to_kwargs(self) -> dict[str, float]:
        return asdict(self)


class WakeBoard(Protocol):
    """Where the fallback's policy marks the GPU decoder of an application woken, until a timestamp."""

    def woken_until(self, app_name: str) -> float: ...

    def wake(self, app_name: str, until: float) -> None: ...


class MemoryWakeBoard:
    """A board in one process: the simulator's and the unit tests'."""

    def __init__(self) -> None:
        self.until: dict[str, float] = {}

    def woken_until(self, app_name: str) -> float:
        return self.until.get(app_name, 0.0)

    def wake(self, app_name: str, until: float) -> None:
        self.until[app_name] = until


class RayWakeBoard:
    """Ray's internal KV (in the GCS): the controller, where both policies run, and the ingress replicas read
    the same entry. (The policies cannot share memory: Serve unpickles each deployment's policy apart.)
    A failed read counts as "not woken" and a failed write is skipped (logged when failures start): the
    policies and the ingress go on with the schedule alone rather than fail."""

    NAMESPACE = "cosyvoice_autoscaling"

    def __init__(self) -> None:
        self._failing = False

    @staticmethod
    def _key(app_name: str) -> bytes:
        return f"wake_until:{app_name}".encode()

    def _failed(self, action: str, exc: Exception) -> None:
        if not self._failing:
            logger.warning("could not %s the GPU decoder's wake mark in Ray's KV: %s", action, exc)
        self._failing = True

    def woken_until(self, app_name: str) -> float:
        from ray.experimental import internal_kv

        try:
            value = internal_kv._internal_kv_get(self._key(app_name), namespace=self.NAMESPACE)
        except Exception as exc:
            self._failed("read", exc)
            return 0.0
        self._failing = False
        return float(value) if value else 0.0

    def wake(self, app_name: str, until: float) -> None:
        from ray.experimental import internal_kv

        key, value = self._key(app_name), repr(until).encode()
        try:
            internal_kv._internal_kv_put(key, value, overwrite=True, namespace=self.NAMESPACE)
        except Exception as exc:
            self._failed("write", exc)
            return
        self._failing = False


def first_audio_wait_s(ctx: Any) -> float:
    """The longest wait any running replica reports (Serve's average of `first_audio_wait_s`), 0 before any report."""
    per_replica = (ctx.aggregated_metrics or {}).get(FIRST_AUDIO_WAIT_S) or {}
    return max(per_replica.values(), default=0.0)


def mean_utilization(ctx: Any) -> float | None:
    """Mean of the running replicas' reported utilization, None before any replica reported."""
    per_replica = (ctx.aggregated_metrics or {}).get(UTILIZATION) or {}
    if not per_replica:
        return None
    return sum(per_replica.values()) / len(per_replica)


def waiting_requests(ctx: Any) -> float:
    """Requests not yet in a batch: waiting inside replicas plus queued at the handles."""
    in_replicas = sum(((ctx.aggregated_metrics or {}).get(QUEUE_DEPTH) or {}).values())
    return in_replicas + (ctx.total_queued_requests or 0.0)


class UtilizationHistory:
    """Time-weighted utilization since the window start, in `bucket_s` buckets of [start, integral, seconds].

    Lives in `policy_state` (plain lists), so it is as durable as the rest of the policy's memory.
    """

    def __init__(self, state: dict[str, Any], bucket_s: float, keep_s: float) -> None:
        self.buckets: list[list[float]] = [list(b) for b in state.get(STATE_UTILIZATION_BUCKETS) or []]
        self.bucket_s = bucket_s
        self.keep_s = keep_s

    def add(self, utilization: float, now: float, seconds: float) -> None:
        """The reading seen at `now` held for the `seconds` before it (the time since the last tick)."""
        if seconds <= 0:
            return
        if not self.buckets or now >= self.buckets[-1][0] + self.bucket_s:
            self.buckets.append([now, 0.0, 0.0])
        self.buckets[-1][1] += utilization * seconds
        self.buckets[-1][2] += seconds
        while self.buckets and self.buckets[0][0] + self.bucket_s < now - self.keep_s:
            self.buckets.pop(0)

    def mean(self, now: float, window_s: float) -> float | None:
        """Time-weighted mean over [now - window_s, now] (a bucket that straddles the start counts in part)."""
        start = now - window_s
        integral = seconds = 0.0
        for bucket_start, bucket_integral, bucket_seconds in self.buckets:
            share = min(1.0, max(0.0, (bucket_start + self.bucket_s - start) / self.bucket_s))
            integral += share * bucket_integral
            seconds += share * bucket_seconds
        return integral / seconds if seconds > 0 else None

    def save(self, state: dict[str, Any]) -> None:
        state[STATE_UTILIZATION_BUCKETS] = self.buckets


def decide(ctx: Any, rules: ScalingRules, bounds: tuple[int, int]) -> tuple[int, dict[str, Any], str]:
    """One policy tick: the desired replica count within `bounds`, the updated `policy_state`, and the
    reason (one of `DECISION_REASONS`; "hold" when the count stays)."""
    now = ctx.current_time if ctx.current_time is not None else time.time()
    state = dict(ctx.policy_state or {})
    target = ctx.target_num_replicas

    # When Serve actually moved the target, whoever caused it, the windows restart: utilization measured at the old
    # replica count says nothing about the new one (so a utilization step waits a whole window after any change).
    if state.get(STATE_LAST_TARGET) != target:
        state[STATE_LAST_TARGET] = target
        state[STATE_WINDOW_SINCE] = state[STATE_LAST_TICK] = now
        state[STATE_UTILIZATION_BUCKETS] = []

    history = UtilizationHistory(state, rules.bucket_s, max(rules.scale_up_window_s, rules.scale_down_window_s))
    utilization = mean_utilization(ctx)
    if utilization is not None:
        history.add(utilization, now, now - state.get(STATE_LAST_TICK, now))
    history.save(state)
    state[STATE_LAST_TICK] = now
    observed_s = now - state.setdefault(STATE_WINDOW_SINCE, now)  # setdefault: a state from an older policy

    def window_mean(window_s: float) -> float | None:
        """The mean over a window that the history covers in full; None before that."""
        if observed_s < window_s or utilization is None:
            return None
        return utilization if window_s <= 0 else history.mean(now, window_s)

    up_mean, down_mean = window_mean(rules.scale_up_window_s), window_mean(rules.scale_down_window_s)

    waiting = waiting_requests(ctx)
    running = max(ctx.current_num_replicas, 1)
    desired, reason = target, "hold"
    if waiting / running > rules.target_queue_per_replica:
        proportional = math.ceil(waiting / rules.target_queue_per_replica)
        desired = max(target, min(proportional, math.ceil(QUEUE_SCALE_UP_FACTOR * running)))
        reason = "queue_depth"
    elif up_mean is not None and up_mean > rules.scale_up_utilization:
        desired = target + 1  # asked for on every tick until Serve applies it (its delays need that)
        reason = "high_utilization"
    elif down_mean is not None and down_mean < rules.scale_down_utilization and waiting == 0:
        desired = target - 1
        reason = "low_utilization"

    low, high = bounds
    high = min(high, ctx.capacity_adjusted_max_replicas)
    bounded = max(low, min(high, desired))
    return bounded, state, reason if bounded == desired else "bounds"


DECISION_REASONS = ("hold", "queue_depth", "high_utilization", "low_utilization", "bounds", "wake")


class _ReportingPolicy:
    """Counts each change of the target it asks for in `cosyvoice_autoscaling_decisions_total`.

    The metric is built on first use, on the controller (the policy object is pickled before that).
    """

    _metrics: AutoscalingMetrics | None = None
    _last_reported: tuple[int, int] | None = None

    def report(self, ctx: Any, decision: tuple[int, dict[str, Any], str]) -> tuple[int, dict[str, Any]]:
        desired, state, reason = decision
        target = ctx.target_num_replicas
        # A decision is asked for on every tick until Serve applies it: count it once.
        if desired != target and (target, desired) != self._last_reported:
            if self._metrics is None:
                self._metrics = AutoscalingMetrics()
            tags = {"deployment": ctx.deployment_name, "direction": "up" if desired > target else "down"}
            self._metrics.decisions.inc(tags={**tags, "reason": reason})
            logger.info("autoscaling %s: %d -> %d replicas (%s)", ctx.deployment_name, target, desired, reason)
        self._last_reported = (target, desired)
        return desired, state


class DecoderAutoscalingPolicy(_ReportingPolicy):
    """Serve policy class for the GPU (or CPU-only) decoder: `policy_kwargs` are `ScalingRules` fields, and
    `wake` (`WakeRule` fields) raises a 0 floor to 1 while the CPU fallback's policy marks it woken on `board`
    (default: Ray's internal KV, read at most once a second). While woken replicas are busier than
    `scale_down_utilization`, this policy renews the mark itself: the load that woke them now runs here, where
    the fallback's policy no longer sees it, and draining it back to the fallback would wake them again."""

    def __init__(self, wake: Mapping[str, Any] | None = None, board: WakeBoard | None = None, **policy_kwargs: Any):
        self.rules = ScalingRules.from_kwargs(policy_kwargs)
        self.wake = WakeRule.from_kwargs(wake)
        self.board = board
        self._read: tuple[float, float] | None = None  # (read at, woken until)

    def woken(self, app_name: str, now: float) -> bool:
        if self._read is None or not 0 <= now - self._read[0] < 1.0:
            self.board = self.board or RayWakeBoard()
            self._read = (now, self.board.woken_until(app_name))
        return now < self._read[1]

    def renew(self, app_name: str, now: float) -> None:
        """Move the mark to `hold_s` from now (written at most once a second, like the fallback's)."""
        assert self.wake is not None and self.board is not None and self._read is not None  # woken() ran
        until = now + self.wake.hold_s
        if until - self._read[1] >= 1.0:
            self.board.wake(app_name, until)
            self._read = (now, until)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time if ctx.current_time is not None else time.time()
        low, high = self.rules.bounds_at(now)
        woken = self.wake is not None and low == 0 and self.woken(ctx.app_name, now)
        if woken and (mean_utilization(ctx) or 0.0) >= self.rules.scale_down_utilization:
            self.renew(ctx.app_name, now)
        desired, state, reason = decide(ctx, self.rules, (1, max(1, high)) if woken else (low, high))
        if woken and reason == "bounds" and desired > ctx.target_num_replicas:
            reason = "wake"
        return self.report(ctx, (desired, state, reason))


def decoder_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Plain-function form of `DecoderAutoscalingPolicy` with the default rules."""
    return _DEFAULT_DECODER_POLICY(ctx)


_DEFAULT_DECODER_POLICY = DecoderAutoscalingPolicy()


class CpuFallbackAutoscalingPolicy(_ReportingPolicy):
    """Serve policy for the CPU fallback decoder: at least one replica exactly while the GPU schedule's
    floor is 0, widened by `lead_s` before (so it is warm when the GPU replicas may go) and `handover_s`
    after (while GPU replicas start again); else scale to 0.

    `gpu` holds the GPU decoder's `ScalingRules` kwargs (its schedule decides); the remaining kwargs
    are this deployment's own `ScalingRules` (its `min_replicas` is raised to 1 while active).
    With `wake` (`WakeRule` fields), load past the rule (`WakeRule.fires`) marks the GPU decoder woken on `board`
    (default: Ray's internal KV) until `hold_s` from now.
    """

    def __init__(
        self,
        gpu: Mapping[str, Any] | None = None,
        lead_s: float = 600.0,
        handover_s: float = 900.0,
        wake: Mapping[str, Any] | None = None,
        board: WakeBoard | None = None,
        **policy_kwargs: Any,
    ) -> None:
        if lead_s < 0 or handover_s < 0:
            raise ValueError("lead_s and handover_s must be >= 0")
        self.gpu_rules = ScalingRules.from_kwargs(gpu or {})
        self.lead_s = lead_s
        self.handover_s = handover_s
        self.wake = WakeRule.from_kwargs(wake)
        self.board = board
        self._marked_until = 0.0
        rules = ScalingRules.from_kwargs({"schedule": {}, **policy_kwargs})
        self.rules = rules.model_copy(
            update={"min_replicas": max(1, rules.min_replicas), "max_replicas": max(1, rules.max_replicas)}
        )

    def active(self, timestamp: float) -> bool:
        checked = (timestamp, timestamp + self.lead_s, timestamp - self.handover_s)
        return any(self.gpu_rules.bounds_at(t)[0] == 0 for t in checked)

    def mark_wake(self, ctx: Any, now: float) -> None:
        """Mark the GPU decoder woken while this deployment's load passes the rule (the board is written at most
        once a second: the mark moves on by at least that much)."""
        if self.wake is None or not self.wake.fires(ctx):
            return
        until = now + self.wake.hold_s
        if until - self._marked_until >= 1.0:
            if now >= self._marked_until:
                logger.info("autoscaling %s: its load wakes the GPU decoder (%s)", ctx.deployment_name, self.wake)
            self.board = self.board or RayWakeBoard()
            self.board.wake(ctx.app_name, until)
            self._marked_until = until

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time if ctx.current_time is not None else time.time()
        active = self.active(now)
        if active:
            self.mark_wake(ctx, now)
        bounds = self.rules.bounds_at(now) if active else (0, 0)
        return self.report(ctx, decide(ctx, self.rules, bounds))


def use_cpu_fallback(gpu_running: int, fallback_running: int, gpu_draining: bool) -> bool:
    """The ingress's rule: send decoder work to the CPU fallback rather than the GPU decoder?

    While the GPU schedule's floor is (about to be) 0 (`gpu_draining`), a running fallback takes all work, so the
    GPU replicas drain and their policy scales them down, and no queued request cold-starts one;
    otherwise the GPU decoder while it runs, the fallback while only it runs, and with neither the GPU
    decoder (its queued requests make Serve cold-start a replica).
    """
    return fallback_running > 0 and (gpu_draining or gpu_running == 0)


DRAIN_AHEAD_S = 60.0
"""The ingress drains the GPU decoder this long before its floor reaches 0: its policy may take it to 0
at the first tick of a 0-floor window, and requests routed to it then would cold-start it again."""


def gpu_draining(
    rules: ScalingRules | None, timestamp: float, ahead_s: float = DRAIN_AHEAD_S, woken_until: float = 0.0
) -> bool:
    """Whether the GPU decoder's floor is 0 now or within `ahead_s` (None rules: a fixed-size decoder, never),
    and it is not woken (`woken_until`, from the `WakeBoard`, still ahead): a woken GPU decoder takes the work
    once it runs."""
    if rules is None or timestamp < woken_until:
        return False
    return any(rules.bounds_at(t)[0] == 0 for t in (timestamp, timestamp + ahead_s))


def decoder_autoscaling_config(
    rules: ScalingRules | None = None,
    look_back_period_s: float = 30.0,
    metrics_interval_s: float = 10.0,
    wake: WakeRule | None = None,
) -> dict[str, Any]:
    """Serve `autoscaling_config` for the GPU decoder with `rules` (defaults: the seed's rules), woken by the CPU
    fallback's load under `wake` (None: only the schedule and its own metrics move it)."""
    rules = rules or ScalingRules()
    kwargs = rules.to_kwargs() | ({} if wake is None else {"wake": wake.to_kwargs()})
    return {
        "min_replicas": rules.lowest_floor(),
        "initial_replicas": max(1, rules.min_replicas),
        "max_replicas": max(1, rules.highest_ceiling()),
        "upscale_delay_s": 0.0,  # the policy's windows do the delaying
        "downscale_delay_s": 0.0,
        "look_back_period_s": look_back_period_s,
        "metrics_interval_s": metrics_interval_s,
        "policy": {"policy_function": DECODER_POLICY_PATH, "policy_kwargs": kwargs},
    }


def cpu_fallback_autoscaling_config(
    gpu_rules: ScalingRules | None = None,
    cpu_rules: ScalingRules | None = None,
    lead_s: float = 600.0,
    handover_s: float = 900.0,
    look_back_period_s: float = 30.0,
    metrics_interval_s: float = 10.0,
    wake: WakeRule | None = None,
) -> dict[str, Any]:
    """Serve `autoscaling_config` for the CPU fallback decoder that covers the GPU decoder's 0-floor windows
    (and, with `wake`, wakes the GPU decoder when its own requests wait too long)."""
    gpu_rules = gpu_rules or ScalingRules()
    cpu_rules = cpu_rules or ScalingRules(min_replicas=1, max_replicas=4, schedule=Schedule())
    cpu_kwargs = cpu_rules.to_kwargs() | ({} if wake is None else {"wake": wake.to_kwargs()})
    return {
        "min_replicas": 0,
        "initial_replicas": 0,
        "max_replicas": max(1, cpu_rules.max_replicas),
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "look_back_period_s": look_back_period_s,
        "metrics_interval_s": metrics_interval_s,
        "policy": {
            "policy_function": CPU_FALLBACK_POLICY_PATH,
            "policy_kwargs": {"gpu": gpu_rules.to_kwargs(), "lead_s": lead_s, "handover_s": handover_s, **cpu_kwargs},
        },
    }
