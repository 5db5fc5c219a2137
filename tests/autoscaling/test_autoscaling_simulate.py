"""The day simulator: Serve's post-processing, the summary schema and sanity of the default diurnal day."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import ray.serve.autoscaling_policy as serve_policy
from ray.serve.config import AutoscalingConfig

from autoscaling.policy import DRAIN_AHEAD_S, ScalingRules, WakeRule, decoder_autoscaling_config
from autoscaling.schedule import Schedule
from autoscaling.simulate import (
    DEFAULT_SERVICE_RATES,
    POLICIES,
    REPOSITORY,
    ServiceModel,
    ServiceRates,
    load_service_rates,
    load_trace,
    main,
    serve_decision,
)
from serve_app.bench.http_load import LevelResult
from tests.autoscaling.test_autoscaling_policy import NOON, make_context

SUMMARY_KEYS = {"replica_hours", "static_peak_replica_hours", "cost_ratio", "p95_queue_s", "slo_violation_fraction"}
# Rates at which one CPU fallback replica keeps up with the default night (batches of 4 in 4.8 s), for tests of
# the routing and the schedule alone; the measured rates are `load_service_rates()`'s.
KEEPING_UP = ServiceRates(
    gpu=ServiceModel(max_batch_size=8, batch_latency_s={1: 0.25, 8: 0.6}, startup_s=90.0),
    cpu=ServiceModel(max_batch_size=4, batch_latency_s={1: 1.5, 4: 4.8}, startup_s=60.0),
    source={"gpu": "test", "cpu": "test"},
    format="test",
)


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


def test_summary_compares_the_three_night_policies_and_names_each_rate_source(default_day: tuple[dict, Path]) -> None:
    summary, _ = default_day
    assert summary["policy"] == "fallback_wake" and set(summary["policies"]) == set(POLICIES)
    for figures in summary["policies"].values():
        assert 0 < figures["cost_ratio"] <= 1 and 0 <= figures["slo_violation_fraction"] <= 1
    chosen = summary["policies"]["fallback_wake"]
    assert (summary["cost_ratio"], summary["slo_violation_fraction"]) == (
        chosen["cost_ratio"],
        chosen["slo_violation_fraction"],
    )
    assert summary["policies"]["gpu_only"]["served_by_cpu_fallback"] == 0
    assert summary["wake"]["wait_s"] == summary["slo_s"]  # the rule's default: the SLO
    assert set(summary["service_rates_source"]) == {"gpu", "cpu"}


def test_diurnal_day_saves_cost_within_bounds(default_day: tuple[dict, Path]) -> None:
    summary, _ = default_day
    assert 0 < summary["cost_ratio"] < 1
    assert summary["replica_hours"] == pytest.approx(summary["cost_ratio"] * summary["static_peak_replica_hours"])
    assert summary["serve_min_replicas"] <= summary["min_gpu_replicas"]
    assert summary["max_gpu_replicas"] <= summary["serve_max_replicas"]
    assert summary["unserved_at_end"] == 0
    policies = summary["policies"]
    # The CPU fallback serves fewer requests, and no more of them late, once its load can wake a GPU replica.
    assert policies["fallback_wake"]["served_by_cpu_fallback"] <= policies["cpu_fallback"]["served_by_cpu_fallback"]
    assert policies["fallback_wake"]["slo_violation_fraction"] <= policies["cpu_fallback"]["slo_violation_fraction"]


def test_serve_decision_equals_serves_own_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our simulated-clock post-processing gives what Serve's `_apply_autoscaling_config` gives."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=5, upscale_delay_s=20.0, downscale_delay_s=60.0)
    rules = ScalingRules(
        scale_up_window_s=10.0,
        scale_down_window_s=30.0,
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
    assert rates.format == "service model" and rates.source["gpu"] == str(bench)
    assert gpu.max_batch_size == 4 and gpu.startup_s == 30
    assert gpu.latency_table()[4] == pytest.approx(0.4) and gpu.max_throughput_rps() == pytest.approx(10.0)
    assert cpu == load_service_rates().cpu  # the missing section comes from the recorded rates
    flat = ServiceModel.from_dict({"batch_latency_s": {"2": 1.0}, "startup_s": 5.0})
    assert flat.max_batch_size == 2 and flat.latency_table() == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="needs"):  # no rate: no default to fall back on
        ServiceModel.from_dict({"startup_s": 5.0})
    with pytest.raises(ValueError, match="request_audio_s"):
        ServiceModel.from_dict({"rtf": {"1": 0.1}, "startup_s": 5.0})

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
    assert summary["service_rates_source"]["gpu"] == str(report)
    assert summary["service_rates_source"]["cpu"] == load_service_rates().source["cpu"]
    assert summary["service_rates_format"] == "benchmarks.compare report"
    used = summary["gpu_service"]
    assert used["max_batch_size"] == 8
    assert used["batch_latency_s"]["1"] == pytest.approx(0.5) and used["batch_latency_s"]["8"] == pytest.approx(1.0)
    recorded = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert recorded["service_rates_source"]["gpu"] == str(report)


def test_default_rates_are_the_recorded_measurement_and_the_cited_figure() -> None:
    rates = load_service_rates()
    recorded = json.loads(DEFAULT_SERVICE_RATES.read_text())
    audio_s = recorded["request_audio_s"]
    measured = json.loads((REPOSITORY / recorded["cpu"]["fallback_rates"]).read_text())
    assert set(measured["rtf"]) >= {"1", "2", "4"} and not measured["failed_measurements"]
    cpu_rtf = measured["rtf"]
    assert rates.cpu.batch_latency_s == {int(b): pytest.approx(int(b) * audio_s * r) for b, r in cpu_rtf.items()}
    assert rates.cpu.max_batch_size == measured["max_batch_size"] == 4  # the GPU profile's decoder_cpu
    assert recorded["cpu"]["fallback_rates"] in rates.source["cpu"]["rates"]
    # the start-up recorded is the one measured in the file its source names
    [startup_file] = re.findall(r"docs/fallback_rates/\S+\.json", rates.source["cpu"]["startup"])
    startup = json.loads((REPOSITORY / startup_file).read_text())["startup"]
    assert rates.cpu.startup_s == startup["ready_s"] and startup["ready_s_spread"]["n"] >= 3
    gpu_rtf = recorded["gpu"]["rtf"]
    assert rates.gpu.batch_latency_s == {int(b): pytest.approx(int(b) * audio_s * r) for b, r in gpu_rtf.items()}
    citation = rates.source["gpu"]["rates"]
    assert citation["url"].startswith("https://github.com/FunAudioLLM/CosyVoice/") and "L20" in citation["hardware"]


def test_night_drains_the_gpu_decoder_without_a_cold_start_bounce() -> None:
    """Default rules (night 02:00-06:00 at floor 0): the GPU pool reaches 0 after the drain and stays there
    while night requests go to the CPU fallback; the schedule, not a queued request, brings it back."""
    from autoscaling.simulate import DAY_S, diurnal_rate, simulate

    until_seven = diurnal_rate(np.arange(DAY_S, dtype=np.float64), 30.0)[: 7 * 3600]  # the default day's night
    result = simulate(until_seven, rates_used=KEEPING_UP)
    gpu, routed = result.timeline["gpu_replicas"], result.timeline["routed_to_gpu"]  # per minute from 00:00
    drain_start = 120 - round(DRAIN_AHEAD_S / 60)
    assert routed[drain_start - 1] > 0 and gpu[drain_start] == 1
    assert (routed[drain_start:360] == 0).all(), "requests reached the GPU decoder during the night"
    assert (gpu[120:360] == 0).all(), "a GPU replica came back during the night"
    assert gpu[365] >= 1 and routed[370] > 0  # the 06:00 floor brings it back (90 s start), and work with it
    assert result.summary["served_by_cpu_fallback"] > 0 and result.summary["unserved_at_end"] == 0


def test_a_fallback_that_falls_behind_wakes_a_gpu_replica_at_night() -> None:
    """A CPU fallback too slow for the default night (one request at a time, 8 s each): without the wake rule its
    queue grows all night; with it, the GPU decoder is woken inside the 0-floor window and takes the work."""
    from autoscaling.simulate import DAY_S, diurnal_rate, simulate

    until_seven = diurnal_rate(np.arange(DAY_S, dtype=np.float64), 30.0)[: 7 * 3600]
    slow = replace(KEEPING_UP, cpu=ServiceModel(max_batch_size=1, batch_latency_s={1: 8.0}, startup_s=60.0))
    alone = simulate(until_seven, rates_used=slow)
    woken = simulate(until_seven, rates_used=slow, wake=WakeRule(wait_s=3.0, hold_s=900.0))
    night = slice(121, 360)  # 02:01-06:00, minutes
    assert not alone.timeline["gpu_woken"].any() and (alone.timeline["routed_to_gpu"][night] == 0).all()
    # Woken nearly all night: when a hold ends, the ingress drains to the fallback, which soon falls behind again.
    assert woken.timeline["gpu_woken"][night].mean() > 0.9 and woken.timeline["routed_to_gpu"][night].sum() > 0
    assert woken.summary["served_by_cpu_fallback"] < alone.summary["served_by_cpu_fallback"] / 5
    assert woken.summary["slo_violation_fraction"] < alone.summary["slo_violation_fraction"] / 10
