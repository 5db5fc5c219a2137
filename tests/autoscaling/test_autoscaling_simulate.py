"""The day simulator: Serve's post-processing, the summary schema and sanity of the default diurnal day."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import ray.serve.autoscaling_policy as serve_policy
from ray.serve.config import AutoscalingConfig

from autoscaling.policy import DRAIN_AHEAD_S, ScalingRules, decoder_autoscaling_config
from autoscaling.schedule import Schedule
from autoscaling.simulate import DEFAULT_GPU_SERVICE, ServiceModel, load_service_rates, load_trace, main, serve_decision
from benchmarks.http_bench import LevelResult
from tests.autoscaling.test_autoscaling_policy import NOON, make_context

SUMMARY_KEYS = {"replica_hours", "static_peak_replica_hours", "cost_ratio", "p95_queue_s", "slo_violation_fraction"}


@pytest.fixture(scope="module")
def default_day(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("simulated_day")
    main(["--out", str(out)])
    return json.loads((out / "summary.json").read_text()), out


def test_summary_schema_and_png(default_day: tuple[dict, Path]) -> None:
    summary, out = default_day
    assert set(summary) >= SUMMARY_KEYS
    for key in SUMMARY_KEYS:
        assert isinstance(summary[key], float) and np.isfinite(summary[key]), key
    png = (out / "autoscaling_day.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_diurnal_day_saves_cost_within_bounds(default_day: tuple[dict, Path]) -> None:
    summary, _ = default_day
    assert 0 < summary["cost_ratio"] < 1
    assert summary["replica_hours"] == pytest.approx(summary["cost_ratio"] * summary["static_peak_replica_hours"])
    assert summary["serve_min_replicas"] <= summary["min_gpu_replicas"]
    assert summary["max_gpu_replicas"] <= summary["serve_max_replicas"]
    assert summary["min_gpu_replicas"] == 0  # the night window is used
    assert summary["served_by_cpu_fallback"] > 0  # ... and the CPU fallback serves then
    assert summary["unserved_at_end"] == 0
    assert 0 <= summary["slo_violation_fraction"] < 0.05
    assert summary["p95_queue_s"] < summary["slo_s"]


def test_serve_decision_equals_serves_own_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our simulated-clock post-processing gives what Serve's `_apply_autoscaling_config` gives."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=5, upscale_delay_s=20.0, downscale_delay_s=60.0)
    rules = ScalingRules(
        scale_up_window_s=10.0,
        scale_down_window_s=30.0,
        scale_up_cooldown_s=0.0,
        scale_down_cooldown_s=0.0,
        schedule=Schedule(),
    )
    from autoscaling.policy import DecoderAutoscalingPolicy

    ours, theirs = DecoderAutoscalingPolicy(**rules.to_kwargs()), DecoderAutoscalingPolicy(**rules.to_kwargs())
    clock = SimpleNamespace(time=lambda: 0.0)
    monkeypatch.setattr(serve_policy, "time", clock)
    wrapped = serve_policy._apply_autoscaling_config(theirs)
    target_ours = target_theirs = 2
    state_ours: dict = {}
    state_theirs: dict = {}
    seen = set()
    for step in range(400):
        now = NOON + 2.0 * step
        utilization = 0.95 if step < 100 else 0.05
        clock.time = lambda now=now: now
        ctx = make_context(now, target_ours, utilization, policy_state=state_ours, max_replicas=5)
        ctx.config = config
        target_ours, state_ours = serve_decision(ours, ctx, now)
        ctx = make_context(now, target_theirs, utilization, policy_state=state_theirs, max_replicas=5)
        ctx.config = config
        decision, state_theirs = wrapped(ctx)
        target_theirs = max(config.min_replicas, min(config.max_replicas, decision))
        assert (target_ours, state_ours) == (target_theirs, state_theirs), step
        seen.add(target_ours)
    assert seen == {1, 2, 3, 4, 5}  # up to max and down to min, through both delays


def test_service_rates_json_and_csv_trace(tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"gpu": {"throughput_rps": {"1": 5.0, "4": 10.0}, "startup_s": 30}}))
    rates = load_service_rates(bench)
    gpu, cpu = rates.gpu, rates.cpu
    assert (rates.source, rates.format) == (str(bench), "service model")
    assert gpu.max_batch_size == 4 and gpu.startup_s == 30
    assert gpu.latency_table()[4] == pytest.approx(0.4) and gpu.max_throughput_rps() == pytest.approx(10.0)
    assert cpu.batch_latency_s  # defaults kept for the missing section
    flat = ServiceModel.from_dict({"batch_latency_s": {"2": 1.0}}, DEFAULT_GPU_SERVICE)
    assert flat.max_batch_size == 2 and flat.latency_table() == [0.0, 1.0, 1.0]

    trace = tmp_path / "trace.csv"
    trace.write_text("seconds,requests_per_s\n0,2\n43200,10\n86399,2\n")
    trace_rates = load_trace(trace)
    assert trace_rates.shape == (86_400,) and trace_rates[21_600] == pytest.approx(6.0, rel=1e-3)


def test_replicas_stay_within_the_configured_bounds_on_a_flat_overload() -> None:
    from autoscaling.simulate import simulate

    rules = ScalingRules(min_replicas=1, max_replicas=3, schedule=Schedule())
    result = simulate(np.full(3 * 3600, 100.0), rules, cpu_fallback=False)
    config = decoder_autoscaling_config(rules)
    replicas = result.timeline["gpu_replicas"]
    assert replicas.max() == config["max_replicas"] == 3
    assert replicas.min() >= config["min_replicas"]
    assert result.summary["slo_violation_fraction"] > 0.5  # overload is reported, not hidden


def compare_report(throughput_by_concurrency: dict[int, float], max_batch_size: int) -> dict:
    """A `benchmarks.compare` report with these whole-request throughputs (streaming levels beside them)."""
    levels = [
        asdict(LevelResult(mode=mode, concurrency=c, requests=16, errors=0, wall_s=1.0, requests_per_s=rps))
        for c, rps in throughput_by_concurrency.items()
        for mode in ("whole", "stream")
    ]
    return {
        "ray_serve": levels,
        "baseline": [],
        "setup": {"ray_app_args": {"decoder": {"max_batch_size": max_batch_size}}},
    }


def test_service_rates_from_a_compare_report_are_used_and_recorded(tmp_path: Path) -> None:
    report = tmp_path / "compare.json"
    report.write_text(json.dumps(compare_report({1: 2.0, 8: 8.0}, max_batch_size=8)))
    summary = main(["--out", str(tmp_path / "sim"), "--service-rates", str(report), "--peak-rps", "4"])
    assert summary["service_rates_source"] == str(report)
    assert summary["service_rates_format"] == "benchmarks.compare report"
    used = summary["gpu_service"]
    assert used["max_batch_size"] == 8
    assert used["batch_latency_s"]["1"] == pytest.approx(0.5) and used["batch_latency_s"]["8"] == pytest.approx(1.0)
    assert json.loads((tmp_path / "sim" / "summary.json").read_text())["service_rates_source"] == str(report)


def test_night_drains_the_gpu_decoder_without_a_cold_start_bounce() -> None:
    """Default rules (night 02:00-06:00 at floor 0): the GPU pool reaches 0 after the drain and stays there
    while night requests go to the CPU fallback; the schedule, not a queued request, brings it back."""
    from autoscaling.simulate import DAY_S, diurnal_rate, simulate

    until_seven = diurnal_rate(np.arange(DAY_S, dtype=np.float64), 30.0)[: 7 * 3600]  # the default day's night
    result = simulate(until_seven)
    gpu, routed = result.timeline["gpu_replicas"], result.timeline["routed_to_gpu"]  # per minute from 00:00
    drain_start = 120 - round(DRAIN_AHEAD_S / 60)
    assert routed[drain_start - 1] > 0 and gpu[drain_start] == 1
    assert (routed[drain_start:360] == 0).all(), "requests reached the GPU decoder during the night"
    assert (gpu[120:360] == 0).all(), "a GPU replica came back during the night"
    assert gpu[365] >= 1 and routed[370] > 0  # the 06:00 floor brings it back (90 s start), and work with it
    assert result.summary["served_by_cpu_fallback"] > 0 and result.summary["unserved_at_end"] == 0
