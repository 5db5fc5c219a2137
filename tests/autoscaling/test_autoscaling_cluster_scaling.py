"""The GPU profile on a real local Ray cluster: a CPU head with the `cpu_node` resource and a worker that
declares one fake GPU. configs/gpu_cluster.yaml's app runs with the tiny model in fp32 (no CUDA here, so
the 0.25-GPU decoder replicas compute on CPU) and windows shortened to seconds; replica counts are read
from `serve.status()`. One cluster for the module (~60-90 s in all)."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import time
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import yaml
from ray import serve
from ray.cluster_utils import Cluster
from ray.serve import Application

from autoscaling.policy import RayWakeBoard, cpu_fallback_autoscaling_config, decoder_autoscaling_config
from serve_app.args import AppArgs
from serve_app.bench.http_load import free_port
from serve_app.ingress import build_app_with_overrides
from tests.serve.conftest import OBJECT_STORE_BYTES, wait_until

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

APP = "cosyvoice"
PROFILE = Path(__file__).resolve().parents[2] / "configs" / "gpu_cluster.yaml"
CPU_NODE = {"cpu_node": 100}
SECONDS_RULES = {  # the seed's thresholds and windows shortened to seconds
    "min_replicas": 1,
    "max_replicas": 2,
    "scale_up_window_s": 1.0,
    "scale_down_window_s": 3.0,
    "target_queue_per_replica": 2.0,
}
REQUEST = {"text": "Hello there.", "sampling": {"max_token_text_ratio": 3.0}}  # tiny weights: keep decodes short


def profile_args(schedule: dict[str, Any], fallback: bool) -> dict[str, Any]:
    """configs/gpu_cluster.yaml's args, sized for a 2-core machine, with `schedule` and seconds-long windows."""
    (application,) = yaml.safe_load(PROFILE.read_text())["applications"]
    args = deepcopy(application["args"])
    args["model"] = "tiny"
    args.pop("voices_dir")  # the profile's S3 store: this test clones no voice
    args["encoder"].update(int8=False)
    decoder = args["decoder"]
    assert decoder["num_gpus"] == 0.25  # scheduled on the fake GPU, as on the cluster
    decoder.update(dtype="float32", num_cpus=0.2, max_batch_size=2, memory_budget_gb=None)
    decoder["autoscaling"] = {"rules": {**SECONDS_RULES, "schedule": schedule}}
    args["decoder_cpu"].update(enabled=fallback)
    args["limits"]["max_stream_s"] = 30
    return args


def profile_app(args: dict[str, Any]) -> Application:
    """The app of `args` with configs/gpu_cluster.yaml's deployment overrides sized for a 2-core machine, and the
    decoders' policies fed every 0.5 s over a 1 s look-back (their autoscaling_config overridden whole, as a Serve
    config would: the code's, with that timing)."""
    app_args = AppArgs.model_validate(args)
    rules, wake = app_args.decoder.autoscaling.rules, app_args.wake_rule()
    on_cpu_node = {"resources": {"cpu_node": 1}}
    deployments = [
        {"name": "TTSIngress", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1, **on_cpu_node}},
        {
            "name": "Encoder",
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 1},
            "ray_actor_options": {"num_cpus": 0.2, **on_cpu_node},
        },
        {
            "name": "Decoder",
            "max_ongoing_requests": 4,
            "autoscaling_config": decoder_autoscaling_config(rules, 1.0, 0.5, wake),
        },
    ]
    if app_args.decoder_cpu.enabled:
        fallback = cpu_fallback_autoscaling_config(
            rules, app_args.decoder_cpu.scaling_rules, look_back_period_s=1.0, metrics_interval_s=0.5, wake=wake
        )
        deployments.append(
            {
                "name": "DecoderCPU",
                "autoscaling_config": fallback,
                "ray_actor_options": {"num_cpus": 0.2, **on_cpu_node},
            }
        )
    return build_app_with_overrides(args, deployments)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": CPU_NODE, "object_store_memory": OBJECT_STORE_BYTES},
    )
    try:
        cluster.add_node(num_cpus=2, num_gpus=1, object_store_memory=OBJECT_STORE_BYTES)  # the "GPU node"
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def running(name: str) -> int:
    deployments = serve.status().applications[APP].deployments
    return deployments[name].replica_states.get("RUNNING", 0) if name in deployments else 0


async def send(base: str, count: int, concurrency: int) -> list[int]:
    """`count` short synthesis requests, `concurrency` at a time; their HTTP status codes."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:

        async def one() -> int:
            async with gate:
                return (await client.post("/v1/tts", json=REQUEST)).status_code

        return list(await asyncio.gather(*(one() for _ in range(count))))


def test_decoder_scales_from_its_floor_up_under_load_and_back_down(base_url: str) -> None:
    serve.run(profile_app(profile_args({"timezone": "UTC", "windows": []}, fallback=False)), name=APP, route_prefix="/")
    assert running("Decoder") == 1  # the floor (initial_replicas)
    peak = 1
    deadline = time.monotonic() + 60
    while peak < 2 and time.monotonic() < deadline:
        statuses = asyncio.run(send(base_url, count=12, concurrency=8))
        assert set(statuses) == {200}
        peak = max(peak, running("Decoder"))
    assert peak == 2, "no scale-up under sustained load"
    wait_until(lambda: running("Decoder") == 1, 60, "the scale-down back to the floor once idle")


@pytest.fixture(scope="module")
def night_app(base_url: str) -> str:
    """The profile with a night window around now, the CPU fallback, and the wake rule at a fallback wait of
    0.5 s (the first-audio SLO) or 4 requests queued at its handles (means over the 1 s look-back): the night test's
    two-at-a-time requests take ~0.1 s and queue only while a new handle learns its replicas; a burst queues dozens."""
    now = dt.datetime.now(dt.timezone.utc)
    night = {
        "name": "night",
        "start": (now - dt.timedelta(hours=1)).strftime("%H:%M"),
        "end": (now + dt.timedelta(hours=1)).strftime("%H:%M"),
        "min_replicas": 0,
    }
    args = profile_args({"timezone": "UTC", "windows": [night]}, fallback=True)
    args["scheduler"] = {**args.get("scheduler", {}), "target_first_audio_s": 0.5}
    args["decoder_cpu"].update(wake_queued=4.0)
    serve.run(profile_app(args), name=APP, route_prefix="/")
    wait_until(lambda: running("DecoderCPU") >= 1, 60, "the CPU fallback (its policy is active at night)")
    wait_until(lambda: running("Decoder") == 0, 60, "the drained GPU decoder to go to 0")
    return base_url


def test_night_drains_the_gpu_decoder_and_serves_from_the_cpu_fallback_without_a_bounce(night_app: str) -> None:
    # Night requests: all answered by the fallback; no queued request cold-starts a GPU replica.
    for _ in range(3):
        assert set(asyncio.run(send(night_app, count=4, concurrency=2))) == {200}
        assert running("Decoder") == 0 and running("DecoderCPU") >= 1
    time.sleep(2.0)  # longer than a controller round and the ingress's poll: a late cold start would show
    assert running("Decoder") == 0
    assert RayWakeBoard().woken_until(APP) == 0.0  # this light load never passed the wake rule
    health = httpx.get(f"{night_app}/healthz", timeout=10)
    assert health.status_code == 200 and health.json()["running_replicas"]["Decoder"] == 0


def gpu_decoder_requests() -> int:
    """Requests the (one) GPU decoder replica has taken into batches since it started."""
    stats = serve.get_deployment_handle("Decoder", APP).batch_stats.remote().result(timeout_s=30)
    return sum(size * count for size, count in stats["batch_size_counts"].items())


def test_a_night_burst_wakes_the_gpu_decoder_which_then_takes_the_work(night_app: str) -> None:
    started = time.monotonic()
    assert running("Decoder") == 0
    # Bursts of 32 at once: 8 run in a fallback replica, the rest queue at its handle (its bound is 32: none is
    # turned away with a 503).
    while running("Decoder") == 0:
        assert time.monotonic() - started < 90, "no GPU decoder replica woke under the bursts"
        assert set(asyncio.run(send(night_app, count=32, concurrency=32))) == {200}
    assert RayWakeBoard().woken_until(APP) > time.time()  # the fallback's policy woke it, not a queued request
    # Still inside the night window: new work moves to the woken replica once the ingress sees it run.
    deadline = time.monotonic() + 30
    while gpu_decoder_requests() == 0:
        assert time.monotonic() < deadline, "no request reached the woken GPU decoder"
        assert set(asyncio.run(send(night_app, count=2, concurrency=2))) == {200}
    assert running("Decoder") == 1
