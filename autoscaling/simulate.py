"""Replay a 24-hour request trace through the decoder autoscaling policies and a replica queueing model.

    python -m autoscaling.simulate --out DIR [--trace trace.csv] [--service-rates bench.json]

Simulates three policies for the night: `gpu_only` (no CPU fallback), `cpu_fallback` (the fallback alone carries the
0-floor window), `fallback_wake` (the fallback, and its waits wake a GPU replica: `WakeRule`). Writes
DIR/summary.json (each policy's cost ratio and SLO violations, each service rate's source) and
DIR/autoscaling_day.png. Service rates come from a JSON recorded in the repository (`DEFAULT_SERVICE_RATES`).

Model, per 1 s step: Poisson arrivals at the trace's rate, routed by the ingress's rule (`use_cpu_fallback`); one
FIFO queue per pool; a free replica takes min(queue, max_batch_size) requests as one batch of
`batch_latency_s[size]`; new replicas run after `startup_s`. The policies are the SAME objects Serve runs, their
decisions passed through Serve 2.60's own post-processing helpers (`serve_decision`). The approximations against
Serve (tick period, exact busy fractions, one shared queue, unbounded queues): docs/autoscaling.md, "Simulator".
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import (
    _apply_delay_logic,
    _apply_scaling_factors,
    _extract_internal_policy_state,
    _get_cold_start_scale_up_replicas,
)
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from autoscaling.metrics import FIRST_AUDIO_WAIT_S, QUEUE_DEPTH, UTILIZATION
from autoscaling.policy import (
    WAKE_HOLD_S,
    CpuFallbackAutoscalingPolicy,
    DecoderAutoscalingPolicy,
    MemoryWakeBoard,
    ScalingRules,
    WakeRule,
    cpu_fallback_autoscaling_config,
    decoder_autoscaling_config,
    gpu_draining,
    use_cpu_fallback,
)

DAY_S = 86_400
SIMULATED_DATE = (2025, 1, 6)  # any fixed day; the schedule is evaluated in its own time zone
REPOSITORY = Path(__file__).resolve().parents[1]
DEFAULT_SERVICE_RATES = REPOSITORY / "docs" / "autoscaling_service_rates.json"
"""The recorded rates: the CPU fallback's from this project's `benchmarks.fallback_rates` JSON, the GPU's a cited
published figure."""
POLICIES = ("gpu_only", "cpu_fallback", "fallback_wake")
SIMULATED_APP = "simulated"


@dataclass(frozen=True)
class ServiceModel:
    """Batch latency of one replica: `batch_latency_s[b]` seconds for a batch of b (interpolated)."""

    max_batch_size: int
    batch_latency_s: Mapping[int, float]
    startup_s: float

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or not self.batch_latency_s or min(self.batch_latency_s.values()) <= 0:
            raise ValueError("service model needs max_batch_size >= 1 and positive batch latencies")

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any], request_audio_s: float | None = None) -> ServiceModel:
        """From a section: `batch_latency_s` {size: s}, `throughput_rps` {size: req/s}, `rtf` {size: real-time
        factor} (needs `request_audio_s`: a batch of b takes b x audio x rtf), or `fallback_rates` (a
        `benchmarks.fallback_rates` JSON, repository-relative: its `rtf` by batch size and its `max_batch_size`);
        and `startup_s`."""
        if "batch_latency_s" in spec:
            latency = {int(size): float(seconds) for size, seconds in spec["batch_latency_s"].items()}
        elif "throughput_rps" in spec:
            latency = {int(size): int(size) / float(rps) for size, rps in spec["throughput_rps"].items()}
        elif "rtf" in spec or "fallback_rates" in spec:
            if request_audio_s is None:
                raise ValueError("`rtf` and `fallback_rates` rates need `request_audio_s`")
            if "fallback_rates" in spec:
                measured = json.loads((REPOSITORY / spec["fallback_rates"]).read_text())
                spec = {**spec, "rtf": measured["rtf"], "max_batch_size": measured["max_batch_size"]}
            latency = {int(size): int(size) * request_audio_s * float(value) for size, value in spec["rtf"].items()}
        else:
            raise ValueError("a service section needs batch_latency_s, throughput_rps, rtf or fallback_rates")
        if "startup_s" not in spec:
            raise ValueError("a service section needs startup_s")
        return cls(
            max_batch_size=int(spec.get("max_batch_size", max(latency))),
            batch_latency_s=latency,
            startup_s=float(spec["startup_s"]),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_batch_size": self.max_batch_size,
            "batch_latency_s": {str(size): seconds for size, seconds in sorted(self.batch_latency_s.items())},
            "startup_s": self.startup_s,
        }

    def latency_table(self) -> list[float]:
        """Latency for batch sizes 0..max_batch_size (index = size)."""
        sizes = sorted(self.batch_latency_s)
        values = [self.batch_latency_s[size] for size in sizes]
        return [0.0, *np.interp(np.arange(1, self.max_batch_size + 1), sizes, values).tolist()]

    def max_throughput_rps(self) -> float:
        table = self.latency_table()
        return max(size / table[size] for size in range(1, self.max_batch_size + 1))


def section_source(spec: Mapping[str, Any], path: Path) -> Any:
    """Where a section's rates came from: its `source` (a citation), else its `fallback_rates` file, else the file;
    with its `startup_source` beside them where it names one."""
    if "source" in spec:
        rates = spec["source"]
    elif "fallback_rates" in spec:
        rates = f"{spec['fallback_rates']} (benchmarks.fallback_rates: rtf by batch size, max_batch_size)"
    else:
        rates = str(path)
    return {"rates": rates, "startup": spec["startup_source"]} if "startup_source" in spec else rates


def compare_report_rates(report: Mapping[str, Any]) -> dict[str, Any]:
    """A service-model section from a `benchmarks.compare` report: one decoder replica's whole-request
    throughput at each measured concurrency, taken as that batch size (its batches reach the concurrency)."""
    levels = [level for level in report["ray_serve"] if level["mode"] == "whole" and level["requests_per_s"] > 0]
    if not levels:
        raise ValueError("the compare report has no whole-request level with a throughput")
    decoder_args = report.get("setup", {}).get("ray_app_args", {}).get("decoder", {})
    throughput = {int(level["concurrency"]): float(level["requests_per_s"]) for level in levels}
    return {"throughput_rps": throughput, "max_batch_size": int(decoder_args.get("max_batch_size", max(throughput)))}


@dataclass(frozen=True)
class ServiceRates:
    """The (gpu, cpu) service models of a run and where each came from (recorded in summary.json)."""

    gpu: ServiceModel
    cpu: ServiceModel
    source: Mapping[str, Any]
    format: str


def load_service_rates(path: Path | None = None) -> ServiceRates:
    """Service models from a JSON file: `{"request_audio_s": s, "gpu": {...}, "cpu": {...}}` (see
    `ServiceModel.from_dict`), or a `benchmarks.compare` report (its Ray Serve levels give the GPU decoder's
    rates); a part the file lacks (a compare report's CPU fallback, say) comes from `DEFAULT_SERVICE_RATES`."""
    path = Path(path) if path is not None else DEFAULT_SERVICE_RATES
    spec = json.loads(path.read_text())
    recorded = json.loads(DEFAULT_SERVICE_RATES.read_text())
    if "ray_serve" in spec:
        kind = "benchmarks.compare report"
        sections = {"gpu": (compare_report_rates(spec) | {"startup_s": recorded["gpu"]["startup_s"]}, path)}
    else:
        kind = "service model"
        sections = {name: (spec[name], path) for name in ("gpu", "cpu") if name in spec}
    models, sources = {}, {}
    for name in ("gpu", "cpu"):
        section, origin = sections.get(name, (recorded[name], DEFAULT_SERVICE_RATES))
        audio_s = (spec if origin == path else recorded).get("request_audio_s")
        models[name] = ServiceModel.from_dict(section, audio_s)
        sources[name] = section_source(section, origin)
    return ServiceRates(gpu=models["gpu"], cpu=models["cpu"], source=sources, format=kind)


def diurnal_rate(seconds: np.ndarray, peak_rps: float) -> np.ndarray:
    """Requests/s over a day: a night trough near 3% of peak, a late-morning and a larger evening peak."""
    hours = seconds / 3600.0
    shape = (
        0.03
        + 0.25 / (1.0 + np.exp(-(hours - 7.5) * 1.5)) * (1.0 / (1.0 + np.exp((hours - 23.0) * 1.5)))
        + 0.45 * np.exp(-(((hours - 11.0) / 2.0) ** 2))
        + 0.70 * np.exp(-(((hours - 19.5) / 1.8) ** 2))
    )
    return peak_rps * shape / shape.max()


def load_trace(path: Path) -> np.ndarray:
    """Per-second rate over one day from a CSV of `seconds,requests_per_s` rows (header optional)."""
    points: list[tuple[float, float]] = []
    with Path(path).open(newline="") as handle:
        for row in csv.reader(handle):
            try:
                points.append((float(row[0]), float(row[1])))
            except (ValueError, IndexError):
                if points:
                    raise ValueError(f"{path}: bad trace row {row!r}") from None
    if not points:
        raise ValueError(f"{path}: no `seconds,requests_per_s` rows")
    points.sort()
    times, rates = zip(*points, strict=True)
    return np.clip(np.interp(np.arange(DAY_S), times, rates), 0.0, None)


def serve_decision(policy: Callable[[Any], tuple[Any, dict]], ctx: AutoscalingContext, now: float) -> tuple[int, dict]:
    """The replica target Serve 2.60 would set from `policy`'s answer, with the simulated clock `now`.

    Mirrors `_apply_autoscaling_config` (cold-start fast path, scaling factors, delays) and the
    controller's `math.ceil` and `apply_bounds` clipping, built from Serve's own helpers.
    """
    cold_start = _get_cold_start_scale_up_replicas(ctx)
    if cold_start is not None:
        decision, state = cold_start, ctx.policy_state
    else:
        internal_state = _extract_internal_policy_state(ctx.policy_state)
        desired, state = policy(ctx)
        desired = _apply_scaling_factors(desired, ctx.current_num_replicas, ctx.config)
        if ctx.current_num_replicas == 0 and desired > 0:
            decision = desired
        else:
            decision, internal_state = _apply_delay_logic(
                max(0, desired), ctx.target_num_replicas, ctx.config, internal_state, _now=now
            )
        state.update(internal_state)
    decision = math.ceil(decision)
    return max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, decision)), state


@dataclass
class Replica:
    """One replica; busy time is booked when a batch starts, `history` holds (t, elapsed busy) samples."""

    replica_id: str
    free_at: float
    batch_size: int = 0
    booked_busy_s: float = 0.0
    history: deque[tuple[float, float]] = field(default_factory=deque)

    def elapsed_busy_s(self, t: float) -> float:
        return self.booked_busy_s - max(0.0, self.free_at - t)

    def utilization(self, t: float, window_s: float) -> float:
        """Busy fraction over the last `window_s` (or since start), what a replica's tracker reports."""
        elapsed = self.elapsed_busy_s(t)
        self.history.append((t, elapsed))
        while len(self.history) > 1 and self.history[1][0] <= t - window_s:
            self.history.popleft()
        since, busy_then = self.history[0]
        return min(1.0, (elapsed - busy_then) / (t - since)) if t > since else 0.0


@dataclass
class PoolStats:
    wait_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    replica_seconds: float = 0.0
    max_provisioned: int = 0
    min_provisioned: int = 1 << 30


class ReplicaPool:
    """One decoder deployment: replicas, its FIFO queue, and its autoscaler state."""

    def __init__(
        self,
        name: str,
        service: ServiceModel,
        policy: Callable[[Any], tuple[Any, dict]],
        config: Mapping[str, Any],
    ) -> None:
        self.name = name
        self.service = service
        self.policy = policy
        self.config = AutoscalingConfig(**config)
        self.max_ongoing = 2 * service.max_batch_size
        self.latency = service.latency_table()
        self.replicas: list[Replica] = []
        self.pending_ready_at: list[float] = []
        self.target = self.config.initial_replicas if self.config.initial_replicas is not None else 0
        self.queue: deque[list[float]] = deque()  # [arrival_s, count], FIFO
        self.waiting = 0
        self.policy_state: dict[str, Any] = {}
        self.stats = PoolStats()
        self._next_id = 0
        self.pending_ready_at = [0.0] * self.target  # the initial replicas run from the start

    @property
    def running(self) -> int:
        return len(self.replicas)

    @property
    def provisioned(self) -> int:
        return len(self.replicas) + len(self.pending_ready_at)

    def enqueue(self, t: float, count: int) -> None:
        if count:
            self.queue.append([t, count])
            self.waiting += count

    def _take(self, size: int, start: float, latency: float) -> None:
        while size:
            group = self.queue[0]
            taken = min(size, int(group[1]))
            self.stats.wait_s.append(start - group[0])
            self.stats.latency_s.append(start - group[0] + latency)
            self.stats.counts.append(taken)
            group[1] -= taken
            size -= taken
            self.waiting -= taken
            if group[1] == 0:
                self.queue.popleft()

    def step(self, t: int) -> None:
        """Advance [t, t+1): start ready replicas, run batches from the queue."""
        while self.pending_ready_at and self.pending_ready_at[0] <= t:
            self.pending_ready_at.pop(0)
            self.replicas.append(Replica(f"{self.name}-{self._next_id}", free_at=float(t)))
            self.replicas[-1].history.append((float(t), 0.0))
            self._next_id += 1
        end = t + 1.0
        for replica in self.replicas if self.waiting else ():
            while self.waiting and replica.free_at < end:
                start = max(replica.free_at, float(t))
                size = min(self.waiting, self.service.max_batch_size)
                latency = self.latency[size]
                self._take(size, start, latency)
                replica.free_at = start + latency
                replica.batch_size = size
                replica.booked_busy_s += latency
        provisioned = len(self.replicas) + len(self.pending_ready_at)
        self.stats.replica_seconds += provisioned
        self.stats.max_provisioned = max(self.stats.max_provisioned, provisioned)
        self.stats.min_provisioned = min(self.stats.min_provisioned, provisioned)

    def utilization(self, t: float) -> dict[str, float]:
        return {r.replica_id: r.utilization(t, self.config.look_back_period_s) for r in self.replicas}

    def context(self, t: int, now: float) -> AutoscalingContext:
        in_replicas = min(self.waiting, self.running * self.max_ongoing)
        per_replica_queue = in_replicas / self.running if self.running else 0.0
        in_batches = sum(r.batch_size for r in self.replicas if r.free_at > t)
        first_audio_wait_s = t - self.queue[0][0] if self.queue else 0.0
        return AutoscalingContext(
            deployment_id=DeploymentID(name=self.name, app_name=SIMULATED_APP),
            deployment_name=self.name,
            app_name=SIMULATED_APP,
            current_num_replicas=self.running,
            target_num_replicas=self.target,
            running_replicas=[r.replica_id for r in self.replicas],
            total_num_requests=float(self.waiting + in_batches),
            total_queued_requests=float(self.waiting - in_replicas),
            aggregated_metrics={
                UTILIZATION: self.utilization(t),
                QUEUE_DEPTH: {r.replica_id: per_replica_queue for r in self.replicas},
                FIRST_AUDIO_WAIT_S: dict.fromkeys((r.replica_id for r in self.replicas), first_audio_wait_s),
            },
            raw_metrics={},
            capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas,
            policy_state=dict(self.policy_state),
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=now,
            config=self.config,
        )

    def autoscale(self, t: int, now: float) -> None:
        self.target, self.policy_state = serve_decision(self.policy, self.context(t, now), now)
        while self.provisioned < self.target:
            self.pending_ready_at.append(t + self.service.startup_s)  # stays sorted: t only grows
        while self.provisioned > self.target:
            if self.pending_ready_at:
                self.pending_ready_at.pop()
            else:  # stop the replica that frees up first
                self.replicas.remove(min(self.replicas, key=lambda r: r.free_at))


def route(gpu: ReplicaPool, cpu: ReplicaPool | None, draining: bool) -> ReplicaPool:
    """The ingress's rule (`use_cpu_fallback`), on the pools' running replicas."""
    if cpu is not None and use_cpu_fallback(gpu.running, cpu.running, draining):
        return cpu
    return gpu


def weighted_quantile(values: Sequence[float], weights: Sequence[int], q: float) -> float:
    if not values:
        return 0.0
    order = np.argsort(values)
    cumulative = np.cumsum(np.asarray(weights, dtype=np.float64)[order])
    index = int(np.searchsorted(cumulative, q * cumulative[-1]))
    return float(np.asarray(values)[order][min(index, len(order) - 1)])


@dataclass
class SimulationResult:
    summary: dict[str, Any]
    timeline: dict[str, np.ndarray]


def simulate(
    rates: np.ndarray,
    gpu_rules: ScalingRules | None = None,
    rates_used: ServiceRates | None = None,
    cpu_fallback: bool = True,
    slo_s: float = 3.0,
    control_period_s: int = 5,
    seed: int = 0,
    wake: WakeRule | None = None,
) -> SimulationResult:
    """Run one day (len(rates) seconds at `rates` requests/s) and summarize it; `rates_used` default: the
    recorded rates; `wake`: the fallback's waits wake a GPU replica (needs `cpu_fallback`)."""
    gpu_rules = gpu_rules or ScalingRules()
    rates_used = rates_used or load_service_rates()
    gpu_service, cpu_service = rates_used.gpu, rates_used.cpu
    board = MemoryWakeBoard()
    wake = wake if cpu_fallback else None
    gpu_config = decoder_autoscaling_config(gpu_rules, wake=wake)
    gpu_policy = DecoderAutoscalingPolicy(board=board, **gpu_config["policy"]["policy_kwargs"])
    gpu = ReplicaPool("decoder", gpu_service, gpu_policy, gpu_config)
    cpu = None
    if cpu_fallback:
        cpu_config = cpu_fallback_autoscaling_config(gpu_rules, wake=wake)
        cpu_policy = CpuFallbackAutoscalingPolicy(board=board, **cpu_config["policy"]["policy_kwargs"])
        cpu = ReplicaPool("decoder_cpu", cpu_service, cpu_policy, cpu_config)
    pools = [pool for pool in (gpu, cpu) if pool is not None]

    zone = ZoneInfo(gpu_rules.schedule.timezone)
    day_start = dt.datetime(*SIMULATED_DATE, tzinfo=zone).timestamp()
    arrivals = np.random.default_rng(seed).poisson(rates)
    arrivals_per_s = arrivals.tolist()
    minutes = math.ceil(len(rates) / 60)
    timeline = {
        name: np.zeros(minutes)
        for name in (
            "rate_rps",
            "gpu_replicas",
            "cpu_replicas",
            "gpu_utilization",
            "waiting",
            "gpu_floor",
            "routed_to_gpu",
            "gpu_woken",
        )
    }
    for t in range(len(rates)):
        now = day_start + t
        pool = route(gpu, cpu, gpu_draining(gpu_rules, now, woken_until=board.woken_until(SIMULATED_APP)))
        pool.enqueue(float(t), arrivals_per_s[t])
        if pool is gpu:
            timeline["routed_to_gpu"][t // 60] += arrivals_per_s[t]
        for pool in pools:
            pool.step(t)
        if t % control_period_s == 0:
            for pool in pools:
                pool.autoscale(t, now)
        if t % 60 == 0:  # sample the state once a minute
            minute = t // 60
            utilization = gpu.utilization(t)
            timeline["gpu_replicas"][minute] = gpu.provisioned
            timeline["cpu_replicas"][minute] = cpu.provisioned if cpu else 0
            timeline["gpu_utilization"][minute] = sum(utilization.values()) / len(utilization) if utilization else 0
            timeline["waiting"][minute] = sum(pool.waiting for pool in pools)
            timeline["gpu_floor"][minute] = gpu_rules.bounds_at(now)[0]
            timeline["gpu_woken"][minute] = float(now < board.woken_until(SIMULATED_APP))

    timeline["rate_rps"] = np.add.reduceat(arrivals, np.arange(0, len(rates), 60)) / 60.0
    waits = [w for pool in pools for w in pool.stats.wait_s]
    latencies = [x for pool in pools for x in pool.stats.latency_s]
    counts = [c for pool in pools for c in pool.stats.counts]
    served = int(sum(counts))
    violations = sum(c for x, c in zip(latencies, counts, strict=True) if x > slo_s)
    unserved = int(sum(pool.waiting for pool in pools))
    hours = len(rates) / 3600.0
    replica_hours = gpu.stats.replica_seconds / 3600.0
    peak_replicas = gpu.stats.max_provisioned
    static_peak_replica_hours = peak_replicas * hours
    summary = {
        "replica_hours": replica_hours,
        "static_peak_replicas": peak_replicas,
        "static_peak_replica_hours": static_peak_replica_hours,
        "cost_ratio": replica_hours / static_peak_replica_hours if static_peak_replica_hours else 0.0,
        "cpu_replica_hours": cpu.stats.replica_seconds / 3600.0 if cpu else 0.0,
        "p50_queue_s": weighted_quantile(waits, counts, 0.50),
        "p95_queue_s": weighted_quantile(waits, counts, 0.95),
        "p95_latency_s": weighted_quantile(latencies, counts, 0.95),
        "slo_s": slo_s,
        "slo_violation_fraction": (violations + unserved) / max(1, served + unserved),
        "requests": int(arrivals.sum()),
        "served_by_cpu_fallback": int(sum(cpu.stats.counts)) if cpu else 0,
        "unserved_at_end": unserved,
        "min_gpu_replicas": gpu.stats.min_provisioned,
        "max_gpu_replicas": peak_replicas,
        "serve_min_replicas": gpu.config.min_replicas,
        "serve_max_replicas": gpu.config.max_replicas,
        "mean_gpu_utilization_when_running": float(
            timeline["gpu_utilization"][timeline["gpu_replicas"] > 0].mean()
            if (timeline["gpu_replicas"] > 0).any()
            else 0
        ),
        "hours": hours,
        "control_period_s": control_period_s,
        "service_rates_source": dict(rates_used.source),
        "service_rates_format": rates_used.format,
        "gpu_service": gpu_service.to_dict(),
        "cpu_service": cpu_service.to_dict() if cpu_fallback else None,
        "rules": gpu_rules.to_kwargs(),
        "wake": wake.to_kwargs() if wake else None,
    }
    return SimulationResult(summary=summary, timeline=timeline)


def plot_day(timeline: Mapping[str, np.ndarray], path: Path) -> None:
    """Four stacked panels over the day: load, replicas, GPU utilization, waiting requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = np.arange(len(timeline["rate_rps"])) / 60.0
    figure, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
    axes[0].plot(hours, timeline["rate_rps"], color="tab:blue")
    axes[0].set_ylabel("load (req/s)")
    axes[1].step(hours, timeline["gpu_replicas"], where="post", label="GPU decoder replicas")
    axes[1].step(hours, timeline["cpu_replicas"], where="post", label="CPU fallback replicas")
    axes[1].step(hours, timeline["gpu_floor"], where="post", linestyle=":", color="gray", label="GPU schedule floor")
    woken = timeline["gpu_woken"] > 0
    if woken.any():
        top = max(1.0, float(timeline["gpu_replicas"].max()))
        axes[1].fill_between(hours, 0, top, where=woken, step="post", alpha=0.15, color="tab:orange", label="GPU woken")
    axes[1].set_ylabel("replicas")
    axes[1].legend(loc="upper left", fontsize=8)
    axes[2].plot(hours, timeline["gpu_utilization"], color="tab:green")
    axes[2].set_ylim(0, 1.05)
    axes[2].set_ylabel("GPU utilization")
    axes[3].plot(hours, timeline["waiting"], color="tab:red")
    axes[3].set_ylabel("waiting requests")
    axes[3].set_xlabel("hour of day (schedule time zone)")
    axes[3].set_xlim(0, max(hours[-1] if len(hours) else 24, 1))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def policy_summary(summary: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("cost_ratio", "slo_violation_fraction", "replica_hours", "cpu_replica_hours", "served_by_cpu_fallback")
    return {key: summary[key] for key in keys}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m autoscaling.simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for summary.json and the PNG")
    parser.add_argument("--trace", type=Path, help="CSV of `seconds,requests_per_s` (default: diurnal curve)")
    parser.add_argument("--peak-rps", type=float, default=30.0, help="peak of the default diurnal curve")
    parser.add_argument(
        "--service-rates",
        type=Path,
        help=f"service rates JSON (default: {DEFAULT_SERVICE_RATES.relative_to(REPOSITORY)})",
    )
    parser.add_argument("--rules", type=Path, help="JSON of ScalingRules kwargs for the GPU decoder policy")
    parser.add_argument("--policy", choices=POLICIES, default="fallback_wake", help="reported at the top level")
    parser.add_argument("--slo-s", type=float, default=3.0, help="request latency SLO (queue + batch)")
    parser.add_argument("--wake-wait-s", type=float, help="fallback_wake: WakeRule.wait_s (default: the SLO)")
    parser.add_argument("--wake-hold-s", type=float, default=WAKE_HOLD_S, help="fallback_wake: WakeRule.hold_s")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rates = load_trace(args.trace) if args.trace else diurnal_rate(np.arange(DAY_S, dtype=np.float64), args.peak_rps)
    rates_used = load_service_rates(args.service_rates)
    rules = ScalingRules.from_kwargs(json.loads(args.rules.read_text())) if args.rules else ScalingRules()
    wake = WakeRule(wait_s=args.slo_s if args.wake_wait_s is None else args.wake_wait_s, hold_s=args.wake_hold_s)
    results = {
        name: simulate(
            rates,
            rules,
            rates_used,
            cpu_fallback=name != "gpu_only",
            slo_s=args.slo_s,
            seed=args.seed,
            wake=wake if name == "fallback_wake" else None,
        )
        for name in POLICIES
    }
    chosen = results[args.policy]
    summary = {
        **chosen.summary,
        "policy": args.policy,
        "policies": {name: policy_summary(result.summary) for name, result in results.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_day(chosen.timeline, args.out / "autoscaling_day.png")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("gpu_service", "cpu_service", "rules")}, indent=2))
    return summary


if __name__ == "__main__":
    main()
