"""Real Ray Serve on CPU: the decoder policy scales a small busy-time deployment up under load and back down."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from autoscaling.metrics import ReplicaLoadTracker  # noqa: E402
from autoscaling.policy import DECODER_POLICY_PATH, ScalingRules  # noqa: E402
from autoscaling.schedule import Schedule  # noqa: E402

APP = "autoscaling_it"
DEPLOYMENT = "BusyDecoder"
WORK_S = 0.2
MAX_REPLICAS = 3

RULES = ScalingRules(
    min_replicas=1,
    max_replicas=MAX_REPLICAS,
    scale_up_utilization=0.7,
    scale_up_window_s=1.0,
    scale_down_utilization=0.3,
    scale_down_window_s=2.0,
    target_queue_per_replica=4.0,
    scale_up_cooldown_s=1.0,
    scale_down_cooldown_s=2.0,
    schedule=Schedule(),
)


@serve.deployment(
    name=DEPLOYMENT,
    max_ongoing_requests=64,
    ray_actor_options={"num_cpus": 0.25},
    autoscaling_config={
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": MAX_REPLICAS,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2.0,
        "policy": {"policy_function": DECODER_POLICY_PATH, "policy_kwargs": RULES.to_kwargs()},
    },
)
class BusyDecoder:
    """Serves one request at a time (a batch of 1) and reports the decoder metrics contract."""

    def __init__(self) -> None:
        self.tracker = ReplicaLoadTracker(max_batch_size=1, window_s=2.0)
        self.lock = asyncio.Lock()

    async def __call__(self, work_s: float) -> int:
        self.tracker.request_accepted()
        try:
            async with self.lock:
                self.tracker.batch_started(1)
                try:
                    await asyncio.sleep(work_s)
                finally:
                    self.tracker.batch_finished()
        finally:
            self.tracker.request_finished()
        return 1

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.tracker.snapshot()


@pytest.fixture(scope="module")
def ray_instance():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def running_replicas() -> int:
    deployments = serve.status().applications[APP].deployments
    return deployments[DEPLOYMENT].replica_states.get("RUNNING", 0)


def test_policy_scales_up_under_load_and_back_down(ray_instance) -> None:
    handle = serve.run(BusyDecoder.bind(), name=APP, route_prefix=None)
    assert handle.remote(0.0).result(timeout_s=60) == 1
    assert running_replicas() == 1

    peak = 1
    deadline = time.monotonic() + 45
    while peak < 2 and time.monotonic() < deadline:
        responses = [handle.remote(WORK_S) for _ in range(24)]
        assert sum(response.result(timeout_s=60) for response in responses) == 24
        peak = max(peak, running_replicas())
    assert peak >= 2, "no scale-up under sustained load"
    assert peak <= MAX_REPLICAS

    deadline = time.monotonic() + 45
    while running_replicas() > 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert running_replicas() == 1, "no scale-down back to min_replicas once idle"
