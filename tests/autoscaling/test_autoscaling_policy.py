"""Decoder autoscaling policy, schedules and the replica metrics tracker, driven over simulated time."""

from __future__ import annotations

import datetime as dt
import json
import logging
import random
import threading
from collections.abc import Callable
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import yaml
from ray.serve._private.common import DeploymentID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from autoscaling.metrics import (
    FIRST_AUDIO_WAIT_S,
    METRIC_NAMES,
    QUEUE_DEPTH,
    UTILIZATION,
    GpuProbe,
    ReplicaLoadTracker,
    UtilizationSampler,
    gpu_utilization_sampler,
    nvml_device_id,
)
from autoscaling.policy import (
    QUEUE_SCALE_UP_FACTOR,
    CpuFallbackAutoscalingPolicy,
    DecoderAutoscalingPolicy,
    MemoryWakeBoard,
    ScalingRules,
    WakeRule,
    cpu_fallback_autoscaling_config,
    decoder_autoscaling_config,
    decoder_policy,
    gpu_draining,
)
from autoscaling.schedule import Schedule, ScheduleWindow

UTC = ZoneInfo("UTC")
NO_SCHEDULE = Schedule()
# A Monday noon in UTC: outside the windows used below unless a test sets its own.
NOON = dt.datetime(2025, 1, 6, 12, 0, tzinfo=UTC).timestamp()

GPU_PROFILE = Path(__file__).resolve().parents[2] / "configs" / "gpu_cluster.yaml"


def make_context(
    now: float,
    target: int,
    utilization: float | None,
    queue_per_replica: float = 0.0,
    running: int | None = None,
    policy_state: dict | None = None,
    max_replicas: int = 8,
    handle_queued: float = 0.0,
) -> AutoscalingContext:
    running = target if running is None else running
    replicas = [f"r{i}" for i in range(running)]
    metrics = {QUEUE_DEPTH: dict.fromkeys(replicas, queue_per_replica)}
    if utilization is not None:
        metrics[UTILIZATION] = dict.fromkeys(replicas, utilization)
    return AutoscalingContext(
        deployment_id=DeploymentID(name="decoder", app_name="test"),
        deployment_name="decoder",
        app_name="test",
        current_num_replicas=running,
        target_num_replicas=target,
        running_replicas=replicas,
        total_num_requests=queue_per_replica * running + handle_queued,
        total_queued_requests=handle_queued,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=0,
        capacity_adjusted_max_replicas=max_replicas,
        policy_state=dict(policy_state or {}),
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=AutoscalingConfig(min_replicas=0, max_replicas=max_replicas),
    )


def drive(
    policy: Callable,
    start: float,
    seconds: float,
    target: int,
    utilization: Callable[[float], float | None],
    queue_per_replica: Callable[[float], float] = lambda _: 0.0,
    step_s: float = 5.0,
) -> list[tuple[float, int]]:
    """Tick the policy every `step_s` like the controller, applying each decision at once (delays 0)."""
    state: dict = {}
    history = []
    elapsed = 0.0
    while elapsed <= seconds:
        ctx = make_context(
            start + elapsed, target, utilization(elapsed), queue_per_replica(elapsed), policy_state=state
        )
        target, state = policy(ctx)
        history.append((elapsed, target))
        elapsed += step_s
    return history


def first_change(history: list[tuple[float, int]], initial: int) -> tuple[float, int] | None:
    return next(((t, n) for t, n in history if n != initial), None)


def rules(**overrides) -> ScalingRules:
    return ScalingRules(schedule=NO_SCHEDULE, **overrides)


def test_defaults_are_the_seed_rules() -> None:
    defaults = ScalingRules()
    assert (defaults.scale_up_utilization, defaults.scale_up_window_s) == (0.70, 300.0)
    assert (defaults.scale_down_utilization, defaults.scale_down_window_s) == (0.30, 1200.0)
    assert [w.min_replicas for w in defaults.schedule.windows] == [2, 0]


def test_scale_up_after_utilization_stays_high_for_the_window() -> None:
    policy = DecoderAutoscalingPolicy(**rules().to_kwargs())
    history = drive(policy, NOON, 400, target=2, utilization=lambda _: 0.85)
    assert first_change(history, 2) == (300.0, 3)


def dips_once_a_minute(level: float, dip: float, dip_s: float = 10.0) -> Callable[[float], float]:
    """`level`, except `dip` for the first `dip_s` of every minute (one metrics push of 10 s)."""
    return lambda t: dip if t % 60 < dip_s else level


def noisy(level: float, spread: float, seed: int = 0) -> Callable[[float], float]:
    """`level` plus uniform noise in [-spread, spread] per reading, clipped to 0..1 (seeded)."""
    generator = random.Random(seed)
    return lambda _: min(1.0, max(0.0, level + generator.uniform(-spread, spread)))


def test_one_dip_a_minute_neither_restarts_nor_blocks_the_up_window() -> None:
    """The case that once reset the up window: 0.8 with one 0.65 reading a minute still scales up after the seed's
    5 minutes."""
    policy = DecoderAutoscalingPolicy(**rules().to_kwargs())
    history = drive(policy, NOON, 400, target=2, utilization=dips_once_a_minute(0.8, 0.65))
    assert first_change(history, 2) == (300.0, 3)
    # a deep dip (one reading at 0.1) at 200 s does not restart the window either
    policy = DecoderAutoscalingPolicy(**rules().to_kwargs())
    history = drive(policy, NOON, 400, target=2, utilization=lambda t: 0.1 if t == 200 else 0.85)
    assert first_change(history, 2) == (300.0, 3)


def test_seed_rules_hold_under_noisy_readings() -> None:
    # +1 after 5 min of noisy load around 0.8, readings often below 0.7
    history = drive(DecoderAutoscalingPolicy(**rules().to_kwargs()), NOON, 400, 2, noisy(0.8, 0.2))
    assert first_change(history, 2) == (300.0, 3)
    # -1 after 20 min of noisy load around 0.15, readings often above 0.3
    history = drive(DecoderAutoscalingPolicy(**rules().to_kwargs()), NOON, 1300, 3, noisy(0.15, 0.25, seed=1))
    assert first_change(history, 3) == (1200.0, 2)
    # around 0.5 with readings on both sides of both thresholds: neither rule fires in an hour
    history = drive(DecoderAutoscalingPolicy(**rules().to_kwargs()), NOON, 3600, 2, noisy(0.5, 0.45, seed=2))
    assert {n for _, n in history} == {2}


def test_a_spike_or_a_short_burst_triggers_no_window() -> None:
    # low load with one 0.95 reading a minute: still scales down after 20 min, never up
    history = drive(DecoderAutoscalingPolicy(**rules().to_kwargs()), NOON, 1300, 3, dips_once_a_minute(0.1, 0.95))
    assert first_change(history, 3) == (1200.0, 2)
    # one minute at full load inside a quiet period: no scale-up
    burst = drive(
        DecoderAutoscalingPolicy(**rules().to_kwargs()), NOON, 900, 2, lambda t: 1.0 if 400 <= t < 460 else 0.4
    )
    assert {n for _, n in burst} == {2}


def test_scale_down_only_after_the_long_low_window() -> None:
    policy = DecoderAutoscalingPolicy(**rules().to_kwargs())
    history = drive(policy, NOON, 1300, target=3, utilization=lambda _: 0.1)
    assert first_change(history, 3) == (1200.0, 2)


def test_no_scale_down_while_requests_wait() -> None:
    policy = DecoderAutoscalingPolicy(**rules(target_queue_per_replica=100.0).to_kwargs())
    history = drive(policy, NOON, 1500, target=3, utilization=lambda _: 0.1, queue_per_replica=lambda _: 1.0)
    assert {n for _, n in history} == {3}


def test_dead_band_between_thresholds_holds() -> None:
    policy = DecoderAutoscalingPolicy(**rules().to_kwargs())
    history = drive(policy, NOON, 3000, target=2, utilization=lambda _: 0.5)
    assert {n for _, n in history} == {2}


def test_repeated_steps_wait_a_fresh_window() -> None:
    policy = DecoderAutoscalingPolicy(**rules().to_kwargs())
    history = drive(policy, NOON, 1200, target=1, utilization=lambda _: 0.9)
    changes = [(t, n) for (t, n), (_, previous) in zip(history[1:], history, strict=False) if n != previous]
    assert changes[0] == (300.0, 2)
    # the window restarts at 305 s, the first tick that sees the new target, and is whole again 300 s later
    assert changes[1] == (605.0, 3)


def test_any_change_of_the_target_restarts_the_windows() -> None:
    policy = DecoderAutoscalingPolicy(**rules(scale_down_window_s=300.0).to_kwargs())
    state: dict = {}
    for elapsed in range(0, 301, 5):
        target, state = policy(make_context(NOON + elapsed, 3, 0.1, policy_state=state))
    assert target == 2  # the low window elapsed while the target stayed 3
    # Serve moved the target (e.g. an operator or a burst) at t=1300: downscale waits a whole low window again
    history = []
    for elapsed in range(1300, 2000, 5):
        target, state = policy(make_context(NOON + elapsed, 4, 0.1, policy_state=state))
        history.append((elapsed, target))
    assert first_change(history, 4) == (1600, 3)


def test_queue_above_target_scales_at_once_in_proportion() -> None:
    policy = DecoderAutoscalingPolicy(**rules(target_queue_per_replica=4.0).to_kwargs())
    target, _ = policy(make_context(NOON, 2, 0.5, queue_per_replica=5.0))
    assert target == 3  # 10 waiting / 4 per replica
    target, _ = policy(make_context(NOON, 2, 0.5, queue_per_replica=40.0))
    assert target == 2 * QUEUE_SCALE_UP_FACTOR  # capped at 2 x the 2 running replicas
    target, _ = policy(make_context(NOON, 2, 0.5, queue_per_replica=4.0))
    assert target == 2  # at the target: no change


def test_queue_scale_up_does_not_compound_while_replicas_start() -> None:
    policy = DecoderAutoscalingPolicy(**rules(target_queue_per_replica=4.0).to_kwargs())
    state: dict = {}
    for elapsed in range(0, 60, 5):
        ctx = make_context(NOON + elapsed, 4, 0.9, queue_per_replica=8.0, running=2, policy_state=state)
        target, state = policy(ctx)
        assert target == 4  # 16 waiting need 4, already the target while 2 start


def test_handle_queue_counts_as_waiting() -> None:
    policy = DecoderAutoscalingPolicy(**rules(target_queue_per_replica=4.0).to_kwargs())
    target, _ = policy(make_context(NOON, 1, 0.5, handle_queued=8.0))
    assert target == 2


def test_missing_metrics_hold_the_target() -> None:
    policy = DecoderAutoscalingPolicy(**rules().to_kwargs())
    history = drive(policy, NOON, 2000, target=2, utilization=lambda _: None)
    assert {n for _, n in history} == {2}


def test_bounds_and_capacity_are_respected() -> None:
    policy = DecoderAutoscalingPolicy(**rules(min_replicas=2, max_replicas=3).to_kwargs())
    history = drive(policy, NOON, 3000, target=3, utilization=lambda _: 1.0, queue_per_replica=lambda _: 50.0)
    assert {n for _, n in history} == {3}
    history = drive(policy, NOON, 6000, target=2, utilization=lambda _: 0.0)
    assert {n for _, n in history} == {2}
    target, _ = policy(make_context(NOON, 2, 1.0, queue_per_replica=50.0, max_replicas=2))
    assert target == 2  # Serve's capacity-adjusted max wins


def test_foreign_policy_state_keys_are_kept() -> None:
    policy = DecoderAutoscalingPolicy(**rules().to_kwargs())
    serve_keys = {"__decision_counter": 3, "__decision_timestamp": 12.5}
    _, state = policy(make_context(NOON, 2, 0.5, policy_state=serve_keys))
    assert state.items() >= serve_keys.items()
    json.dumps(state)  # plain values only


def test_plain_function_uses_the_default_rules() -> None:
    target, state = decoder_policy(make_context(NOON, 1, 0.5))
    assert target == 2  # noon is inside the default peak window (min 2, UTC)
    assert isinstance(state, dict)


def test_window_contains_and_wraps_midnight() -> None:
    late = ScheduleWindow(name="late", start="22:00", end="02:00", min_replicas=1)
    assert late.contains(dt.time(23, 30)) and late.contains(dt.time(1, 59))
    assert not late.contains(dt.time(2, 0)) and not late.contains(dt.time(21, 59))
    day = ScheduleWindow(name="day", start="09:00", end="24:00")
    assert day.contains(dt.time(23, 59)) and not day.contains(dt.time(8, 59))
    with pytest.raises(ValueError):
        ScheduleWindow(name="empty", start="03:00", end="03:00")
    with pytest.raises(ValueError):
        ScheduleWindow(name="bad", start="9am", end="10:00")
    with pytest.raises(ValueError):
        ScheduleWindow(name="inverted", start="01:00", end="02:00", min_replicas=3, max_replicas=1)


def test_schedule_uses_its_time_zone() -> None:
    schedule = Schedule(
        timezone="Europe/Berlin",
        windows=(ScheduleWindow(name="peak", start="09:00", end="21:00", min_replicas=2, max_replicas=6),),
    )
    berlin_nine = dt.datetime(2025, 1, 6, 9, 0, tzinfo=ZoneInfo("Europe/Berlin")).timestamp()
    assert schedule.bounds_at(berlin_nine, 1, 8) == (2, 6)
    assert schedule.bounds_at(berlin_nine - 1, 1, 8) == (1, 8)  # 08:59 Berlin, 07:59 UTC
    assert Schedule.from_dict(schedule.to_dict()) == schedule
    with pytest.raises(Exception, match="Nowhere"):
        Schedule(timezone="Nowhere/Land")


def test_schedule_floors_apply_at_once_and_night_allows_zero() -> None:
    policy = DecoderAutoscalingPolicy()  # default schedule: peak 09-21 min 2, night 02-06 min 0
    day = dt.datetime(2025, 1, 6, tzinfo=UTC).timestamp()
    target, _ = policy(make_context(day + 9 * 3600, 1, 0.5))
    assert target == 2
    target, _ = policy(make_context(day + 8 * 3600, 0, None))
    assert target == 1  # base floor outside the windows
    history = drive(policy, day + 2 * 3600, 1500, target=1, utilization=lambda _: 0.05)
    assert history[-1][1] == 0  # the night window lets the low-utilization rule reach 0


def test_cpu_fallback_covers_exactly_the_gpu_zero_floor() -> None:
    gpu = ScalingRules()  # night 02:00-06:00 min 0
    fallback = CpuFallbackAutoscalingPolicy(gpu=gpu.to_kwargs(), lead_s=0.0, handover_s=0.0, schedule={})
    day = dt.datetime(2025, 1, 6, tzinfo=UTC).timestamp()
    for minute in range(0, 24 * 60, 10):
        now = day + minute * 60
        target, _ = fallback(make_context(now, 0, None))
        assert (target >= 1) == (gpu.bounds_at(now)[0] == 0), minute


def test_cpu_fallback_margins_and_scale_to_zero() -> None:
    fallback = CpuFallbackAutoscalingPolicy(gpu=ScalingRules().to_kwargs(), lead_s=600.0, handover_s=900.0)
    day = dt.datetime(2025, 1, 6, tzinfo=UTC).timestamp()
    assert fallback(make_context(day + 2 * 3600 - 600, 0, None))[0] == 1  # warm before the GPUs may go
    assert fallback(make_context(day + 2 * 3600 - 601, 0, None))[0] == 0
    assert fallback(make_context(day + 6 * 3600 + 899, 1, 0.1))[0] == 1  # while the GPU replicas start
    assert fallback(make_context(day + 6 * 3600 + 900, 1, 0.1))[0] == 0
    assert fallback(make_context(day + 3 * 3600, 1, 0.9, queue_per_replica=20.0))[0] > 1  # scales while active


# A night window around NOON, with second-long windows, so a tick can scale down soon.
NOON_NIGHT = ScalingRules(
    scale_down_window_s=10.0,
    schedule=Schedule(
        timezone="UTC", windows=(ScheduleWindow(name="night", start="11:00", end="13:00", min_replicas=0),)
    ),
)


class CountingBoard(MemoryWakeBoard):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def wake(self, app_name: str, until: float) -> None:
        self.writes += 1
        super().wake(app_name, until)


def fallback_context(now: float, first_audio_wait_s: float, handle_queued: float = 0.0) -> AutoscalingContext:
    ctx = make_context(now, 1, 1.0, queue_per_replica=3.0, handle_queued=handle_queued)
    ctx.aggregated_metrics[FIRST_AUDIO_WAIT_S] = {"r0": first_audio_wait_s}
    return ctx


def test_fallback_waits_wake_the_gpu_decoder_at_night_for_the_hold_then_it_falls_back() -> None:
    board = CountingBoard()
    wake = WakeRule(wait_s=2.0, hold_s=300.0).to_kwargs()
    gpu = DecoderAutoscalingPolicy(wake=wake, board=board, **NOON_NIGHT.to_kwargs())
    fallback = CpuFallbackAutoscalingPolicy(gpu=NOON_NIGHT.to_kwargs(), wake=wake, board=board, schedule={})
    assert gpu(make_context(NOON, 0, None, running=0))[0] == 0  # the night floor

    fallback(fallback_context(NOON, first_audio_wait_s=1.9))  # waits below the rule's: no wake
    assert board.writes == 0 and gpu(make_context(NOON + 1, 0, None, running=0))[0] == 0

    fallback(fallback_context(NOON + 10, first_audio_wait_s=2.5))
    fallback(fallback_context(NOON + 10.5, first_audio_wait_s=2.5))  # the board is written at most once a second
    assert board.writes == 1 and board.woken_until("test") == NOON + 310

    target, state, history = 0, {}, []
    for step in range(80):  # the woken GPU decoder, idle, ticked every 5 s
        now = NOON + 15 + 5 * step
        target, state = gpu(make_context(now, target, 0.0 if target else None, running=target, policy_state=state))
        history.append((now - NOON, target))
    up_at = next(t for t, n in history if n == 1)
    down_at = next(t for t, n in history if t > up_at and n == 0)
    assert up_at == 15  # at the first tick: the floor is 1 while woken, even inside the night window
    assert 310 <= down_at <= 310 + 10 + 5  # back to the night floor once the hold ends (+ its low window)
    assert all(n == 0 for t, n in history if t >= down_at)


def test_requests_queued_at_the_full_fallbacks_handles_wake_too() -> None:
    board = MemoryWakeBoard()
    wake = WakeRule(wait_s=2.0, hold_s=300.0, queued=1.0).to_kwargs()
    fallback = CpuFallbackAutoscalingPolicy(gpu=NOON_NIGHT.to_kwargs(), wake=wake, board=board, schedule={})
    fallback(fallback_context(NOON, first_audio_wait_s=0.5, handle_queued=0.5))
    assert board.woken_until("test") == 0.0
    fallback(fallback_context(NOON + 1, first_audio_wait_s=0.5, handle_queued=1.0))
    assert board.woken_until("test") == NOON + 301


def test_a_woken_gpu_decoder_busy_with_the_night_load_holds_the_mark() -> None:
    board = MemoryWakeBoard()
    board.wake("test", NOON + 60)
    gpu = DecoderAutoscalingPolicy(
        wake=WakeRule(wait_s=1.0, hold_s=60.0).to_kwargs(), board=board, **NOON_NIGHT.to_kwargs()
    )
    target, state = 1, {}
    for step in range(60):  # 5 minutes at 0.5 utilization (above scale_down_utilization 0.3): held throughout
        now = NOON + 5 * step
        target, state = gpu(make_context(now, target, 0.5, policy_state=state))
        assert target == 1, step
    assert board.woken_until("test") >= NOON + 295 + 60 - 1
    for step in range(60, 90):  # idle: the mark runs out 60 s later, then the night floor takes it to 0
        target, state = gpu(make_context(NOON + 5 * step, target, 0.0, policy_state=state))
    assert target == 0


def test_wake_leaves_other_floors_alone_and_needs_its_rule() -> None:
    board = MemoryWakeBoard()
    board.wake("test", NOON + 3600)
    woken = DecoderAutoscalingPolicy(wake=WakeRule(wait_s=1.0).to_kwargs(), board=board, **NOON_NIGHT.to_kwargs())
    assert woken(make_context(NOON, 0, None, running=0))[0] == 1
    day = dt.datetime(2025, 1, 6, tzinfo=UTC).timestamp()
    assert woken(make_context(day + 14 * 3600, 3, 0.5))[0] == 3  # outside the 0-floor window: no effect
    no_rule = DecoderAutoscalingPolicy(board=board, **NOON_NIGHT.to_kwargs())
    assert no_rule(make_context(NOON, 0, None, running=0))[0] == 0  # without a wake rule the mark is not read


def test_woken_gpu_decoder_is_not_drained_by_the_ingress() -> None:
    assert gpu_draining(NOON_NIGHT, NOON)
    assert not gpu_draining(NOON_NIGHT, NOON, woken_until=NOON + 1)
    assert gpu_draining(NOON_NIGHT, NOON + 1, woken_until=NOON + 1)  # the hold is over
    with pytest.raises(ValueError):
        WakeRule(wait_s=-1.0)


def test_rules_round_trip_through_json_and_reject_unknown_keys() -> None:
    custom = ScalingRules(max_replicas=5, scale_up_window_s=60.0)
    assert ScalingRules.from_kwargs(json.loads(json.dumps(custom.to_kwargs()))) == custom
    with pytest.raises(ValueError, match="unknown"):
        ScalingRules.from_kwargs({"scale_up_threshold": 0.8})
    with pytest.raises(ValueError):
        ScalingRules(scale_up_utilization=0.2, scale_down_utilization=0.3)
    with pytest.raises(ValueError):
        ScalingRules(min_replicas=3, max_replicas=2)


def test_recommended_configs_validate_with_serve() -> None:
    gpu_rules = ScalingRules()
    decoder = AutoscalingConfig(**decoder_autoscaling_config(gpu_rules))
    assert decoder.min_replicas == 0  # the night floor: Serve clips to min_replicas after the policy
    assert decoder.max_replicas == gpu_rules.max_replicas
    assert decoder.upscale_delay_s == decoder.downscale_delay_s == 0
    assert decoder.policy.policy_function == "autoscaling.policy:DecoderAutoscalingPolicy"
    fallback = AutoscalingConfig(**cpu_fallback_autoscaling_config(gpu_rules))
    assert fallback.min_replicas == 0
    CpuFallbackAutoscalingPolicy(**fallback.policy.policy_kwargs)  # kwargs build the policy
    wake = WakeRule(wait_s=1.0, hold_s=60.0)
    for config, policy_class in (
        (decoder_autoscaling_config(gpu_rules, wake=wake), DecoderAutoscalingPolicy),
        (cpu_fallback_autoscaling_config(gpu_rules, wake=wake), CpuFallbackAutoscalingPolicy),
    ):
        kwargs = AutoscalingConfig(**config).policy.policy_kwargs
        assert policy_class(**json.loads(json.dumps(kwargs))).wake == wake


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tracker_reports_busy_fraction_queue_and_batch_fill() -> None:
    clock = FakeClock()
    tracker = ReplicaLoadTracker(max_batch_size=4, window_s=10.0, clock=clock)
    for _ in range(5):
        tracker.request_accepted()
    tracker.batch_started(4)
    clock.now += 3.0
    tracker.batch_finished()
    for _ in range(4):
        tracker.request_finished()
    clock.now += 5.0
    tracker.batch_started(1)
    clock.now += 1.0
    stats = tracker.snapshot()
    assert set(stats) == set(METRIC_NAMES)
    assert all(isinstance(value, float) for value in stats.values())
    assert stats[UTILIZATION] == pytest.approx(0.4)  # 3 s + 1 s (still running) of 10 s
    assert stats[QUEUE_DEPTH] == 0.0
    assert stats["ongoing_requests"] == 1.0
    assert stats["batch_fill"] == pytest.approx((4 + 1) / 2 / 4)
    assert stats["gpu_memory_fraction"] == 0.0
    clock.now += 20.0
    tracker.batch_finished()
    clock.now += 11.0
    assert tracker.snapshot()[UTILIZATION] == 0.0
    assert tracker.snapshot()["batch_fill"] == 0.0


def test_busy_sections_overlapping_count_once_and_slide() -> None:
    clock = FakeClock()
    tracker = ReplicaLoadTracker(max_batch_size=4, window_s=10.0, clock=clock)
    with tracker.busy():
        clock.now += 2.0
        with tracker.busy():  # a concurrent batch inside the first one
            clock.now += 1.0
        clock.now += 1.0
    assert tracker.busy_fraction() == pytest.approx(0.4)
    clock.now += 3.0
    with tracker.busy():
        clock.now += 1.0
        assert tracker.busy_fraction() == pytest.approx(0.5)  # the running section counts too
    clock.now += 20.0
    assert tracker.busy_fraction() == 0.0


def test_batch_fill_over_window_and_batch_size_counts_since_start() -> None:
    clock = FakeClock()
    tracker = ReplicaLoadTracker(max_batch_size=4, window_s=10.0, clock=clock)
    tracker.record_batch(1)
    clock.now += 8.0
    tracker.record_batch(3)
    tracker.record_batch(4)
    assert tracker.batch_fill() == pytest.approx(8 / 3 / 4)
    clock.now += 5.0  # the first batch left the window
    assert tracker.batch_fill() == pytest.approx(3.5 / 4)
    assert dict(tracker.batch_size_counts) == {1: 1, 3: 1, 4: 1}


def test_requests_that_leave_while_queued_leave_the_queue() -> None:
    tracker = ReplicaLoadTracker(max_batch_size=4, clock=FakeClock())
    for _ in range(3):
        tracker.request_accepted()
    tracker.request_finished(waiting=True)  # its caller left before any batch took it
    tracker.record_batch(2)
    assert (tracker.waiting, tracker.ongoing) == (0, 2)
    tracker.request_finished()
    tracker.request_finished()
    assert tracker.snapshot()[QUEUE_DEPTH] == 0.0 and tracker.snapshot()["ongoing_requests"] == 0.0


def test_tracker_reports_how_long_the_oldest_request_without_audio_has_waited() -> None:
    clock = FakeClock()
    tracker = ReplicaLoadTracker(max_batch_size=2, clock=clock)
    assert tracker.snapshot()[FIRST_AUDIO_WAIT_S] == 0.0
    for key in "abc":
        tracker.request_accepted(key=key)
        clock.now += 1.0
    tracker.record_batch(3)  # admitted to the loop, still without audio: they keep counting
    assert tracker.snapshot()[FIRST_AUDIO_WAIT_S] == pytest.approx(3.0)
    tracker.first_audio("a")
    assert tracker.snapshot()[FIRST_AUDIO_WAIT_S] == pytest.approx(2.0)
    tracker.request_finished(key="b")  # left (cancelled or failed) before its audio
    assert tracker.snapshot()[FIRST_AUDIO_WAIT_S] == pytest.approx(1.0)
    tracker.first_audio("c")
    assert tracker.snapshot()[FIRST_AUDIO_WAIT_S] == 0.0


def test_nvml_device_is_chosen_by_uuid_then_visible_devices() -> None:
    assert nvml_device_id(0, "8f2e-11", "3,1") == "GPU-8f2e-11"  # torch's UUID wins over any index
    assert nvml_device_id(0, "GPU-8f2e-11", None) == "GPU-8f2e-11"
    assert nvml_device_id(1, None, "3, 1") == 1  # torch's device 1 is the second visible one: NVML index 1
    assert nvml_device_id(0, None, "3,1") == 3  # not NVML index 0
    assert nvml_device_id(0, None, "GPU-aa,GPU-bb") == "GPU-aa"
    assert nvml_device_id(0, None, "") == 0  # no restriction: the indices agree


def test_sampler_reports_the_mean_of_the_stats_period_and_the_tracker_uses_it() -> None:
    readings = iter([0.2, 0.4, 0.9, 0.5])
    sampler = UtilizationSampler(lambda: next(readings))
    assert sampler.take_mean() is None  # nothing read yet
    tracker = ReplicaLoadTracker(max_batch_size=4, clock=FakeClock(), sampler=sampler)
    assert tracker.snapshot()[UTILIZATION] == 0.0  # busy time until the first reading
    for _ in range(3):
        sampler.sample()
    assert tracker.snapshot()[UTILIZATION] == pytest.approx(0.5)  # (0.2 + 0.4 + 0.9) / 3
    assert tracker.snapshot()[UTILIZATION] == pytest.approx(0.5)  # no new reading: the last mean holds
    sampler.sample()
    assert tracker.snapshot()[UTILIZATION] == pytest.approx(0.5)  # the new period holds only 0.5


def test_sampler_thread_reads_about_every_interval() -> None:
    reads = threading.Semaphore(0)

    def read() -> float:
        reads.release()
        return 0.7

    sampler = UtilizationSampler(read, interval_s=0.01).start()
    try:
        assert all(reads.acquire(timeout=10) for _ in range(3))
    finally:
        sampler.stop()
    assert sampler.take_mean() == pytest.approx(0.7)


def test_missing_nvml_is_logged_and_falls_back_to_busy_time() -> None:
    probe = GpuProbe.__new__(GpuProbe)  # as built where nvidia-ml-py is missing
    probe.device_index, probe._nvml_handle, probe.unavailable_reason = 0, None, "ModuleNotFoundError: pynvml"
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # "ray.serve" does not propagate to the root logger
    logging.getLogger("ray.serve").addHandler(handler)
    try:
        assert gpu_utilization_sampler(probe) is None
    finally:
        logging.getLogger("ray.serve").removeHandler(handler)
    (record,) = [r for r in records if "NVML is unavailable" in r.getMessage()]
    assert "busy time" in record.getMessage() and "nvidia-ml-py" in record.getMessage()


def test_an_encoder_burst_scales_the_encoders_within_the_up_delay() -> None:
    """Serve's default policy with the GPU profile's Encoder autoscaling_config (configs/gpu_cluster.yaml's
    `deployments:`): 32 requests at 1 replica (target 2 each) ask for 16 replicas once `upscale_delay_s` passed, so a
    burst does not wait at the encoders while decoders idle."""
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    from autoscaling.simulate import serve_decision

    (application,) = yaml.safe_load(GPU_PROFILE.read_text())["applications"]
    (encoder,) = [entry for entry in application["deployments"] if entry["name"] == "Encoder"]
    config = AutoscalingConfig(**encoder["autoscaling_config"])  # what the Encoder deployment gets
    target, state, history = 1, {}, []
    for tick in range(80):  # 8 s of 0.1 s controller ticks
        now = NOON + 0.1 * tick
        ctx = make_context(now, target, None, queue_per_replica=2.0, handle_queued=30.0, max_replicas=16)
        ctx.config, ctx.policy_state = config, state
        target, state = serve_decision(replica_queue_length_autoscaling_policy, ctx, now)
        history.append((round(0.1 * tick, 1), target))
    first = first_change(history, 1)
    assert first is not None and first[1] == config.max_replicas == 16
    up_delay_s = config.upscale_delay_s
    assert up_delay_s <= first[0] <= up_delay_s + 0.5
