"""A node lost under load, on a real local 2-node Ray cluster (`ray.cluster_utils.Cluster`).

The head (the `cpu_node` resource) holds the ingress and the encoder; the decoder asks for a fake GPU fraction,
which only the worker declares, so its replica lives there. While streams and whole requests run, the worker is
killed outright (`remove_node(allow_graceful=False)`: its raylet, object store and workers die at once, as in a
crash), then a new worker is added (what a cluster autoscaler would do) so Serve can place the replacement.
Every request must end; streams that had sent no audio complete byte for byte (seeded), started ones end cut or
complete; /healthz goes back to 200 and the decoder back to its one replica, on the new node.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors

from autoscaling.policy import ScalingRules, decoder_autoscaling_config
from serve_app.bench.http_load import free_port
from serve_app.ingress import build_app_with_overrides
from tests.serve.conftest import OBJECT_STORE_BYTES, wait_until, wait_until_healthy

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

APP = "nodeloss"
CPU_NODE = {"cpu_node": 100}
# A fixed length long enough that the load is still decoding when the node goes.
LONG = {"sampling": {"min_token_text_ratio": 15.0, "max_token_text_ratio": 15.0}}
LONGER = {"sampling": {"min_token_text_ratio": 100.0, "max_token_text_ratio": 100.0}}
STREAMS = 4
WHOLE = 2
CLIENT_TIMEOUT_S = 120.0  # generous: a hang shows as a timeout, never as a stuck test
ARGS: dict[str, Any] = {
    "model": "tiny",
    "decoder": {
        "num_gpus": 0.25,  # only the worker has a (fake) GPU: no CUDA here, so it computes on CPU in fp32
        "num_cpus": 0.2,
        "dtype": "float32",
        "memory_budget_gb": None,
        "max_batch_size": 2,
        "autoscaling": {"rules": {"min_replicas": 1, "max_replicas": 1}},
    },
    # The ingress re-sends a stream for REROUTE_S (30 s): it waits for Ray to declare the node dead (~10 s), then for
    # a replacement on the new node (measured here ~20 s after the removal, on 2 CPU cores shared with other work).
    "limits": {"max_stream_s": 60},
}
ON_CPU_NODE = {"resources": {"cpu_node": 1}}
DEPLOYMENTS: list[dict[str, Any]] = [
    {"name": "TTSIngress", "ray_actor_options": {"num_cpus": 0.1, **ON_CPU_NODE}},
    {"name": "Encoder", "ray_actor_options": {"num_cpus": 0.2, **ON_CPU_NODE}},
    {
        "name": "Decoder",
        "max_ongoing_requests": 4,  # the fewest that let its admission batches of 2 fill
        # the code's policy, its replicas reporting every 0.5 s over a 1 s look-back
        "autoscaling_config": decoder_autoscaling_config(ScalingRules(min_replicas=1, max_replicas=1), 1.0, 0.5),
    },
]


def add_gpu_worker(cluster: Cluster) -> Any:
    return cluster.add_node(num_cpus=2, num_gpus=1, object_store_memory=OBJECT_STORE_BYTES)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": CPU_NODE, "object_store_memory": OBJECT_STORE_BYTES},
    )
    try:
        add_gpu_worker(cluster)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def decoder_nodes() -> list[str]:
    """Node ids of the live decoder replica actors, from Ray's state API."""
    actors = list_actors(
        address=ray.get_runtime_context().gcs_address,  # this cluster's, even beside other Rays on the machine
        filters=[("state", "=", "ALIVE")],
        limit=1000,
        raise_on_missing_output=False,
    )
    prefix = f"SERVE_REPLICA::{APP}#Decoder#"
    return [actor.node_id for actor in actors if (actor.name or "").startswith(prefix)]


def running_decoders() -> int:
    return serve.status().applications[APP].deployments["Decoder"].replica_states.get("RUNNING", 0)


def health_status(base_url: str) -> int | None:
    try:
        return httpx.get(f"{base_url}/healthz", timeout=5).status_code
    except httpx.HTTPError:
        return None


class HealthWatch(threading.Thread):
    """Polls /healthz every 0.2 s; records when it first turned non-200 and when 200 again after that."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.down_at: float | None = None
        self.up_at: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and self.up_at is None:
            status = health_status(self.base_url)
            now = time.monotonic()
            if status != 200 and self.down_at is None:
                self.down_at = now
            elif status == 200 and self.down_at is not None:
                self.up_at = now
            time.sleep(0.2)


def test_a_node_lost_under_load(cluster: Cluster) -> None:
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app_with_overrides(ARGS, DEPLOYMENTS), name=APP, route_prefix="/")
    base_url = f"http://127.0.0.1:{port}"
    wait_until_healthy(base_url)
    (worker,) = cluster.worker_nodes
    assert decoder_nodes() == [worker.node_id], "the decoder replica is not on the GPU worker"
    assert ray.get_runtime_context().get_node_id() != worker.node_id  # the driver is on the head

    with httpx.Client(base_url=base_url, timeout=CLIENT_TIMEOUT_S) as http:
        voice = http.get("/v1/voices").json()["voices"][0]
        streams = [
            {"text": f"Stream {i} is here.", "voice": voice, "seed": i, "format": "pcm", "stream": True, **LONG}
            for i in range(STREAMS)
        ]
        streams[0] |= LONGER  # still decoding when the node goes: it is cut
        streams[0]["text"] = "Stream zero goes on for a good while longer than all of the others do."
        wholes = [
            {"text": f"Whole {i} is here.", "voice": voice, "seed": 100 + i, "format": "pcm", **LONG}
            for i in range(WHOLE)
        ]
        expected = [http.post("/v1/tts", json=body).content for body in streams + wholes]  # seeded: same bytes
    assert all(expected)
    received: list[list[bytes]] = [[] for _ in streams]
    ended_at = [0.0 for _ in streams]
    load_started = threading.Event()  # the long stream sends audio, the rest are in flight: the node goes now
    watch = HealthWatch(base_url)

    async def load() -> tuple[list[tuple[int | None, Exception | None]], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT_S) as http:

            async def stream(index: int) -> tuple[int | None, Exception | None]:
                try:
                    async with http.stream("POST", "/v1/tts", json=streams[index]) as response:
                        async for piece in response.aiter_raw():
                            received[index].append(piece)
                        return response.status_code, None
                except httpx.HTTPError as exc:  # a stream cut after its first bytes
                    return None, exc
                finally:
                    ended_at[index] = time.monotonic()

            # The long stream first; once it sends audio, the others, which find it mid-way in the decoder.
            in_flight = [asyncio.ensure_future(stream(0))]
            while not received[0] and not in_flight[0].done():
                await asyncio.sleep(0.02)
            in_flight += [asyncio.ensure_future(stream(i)) for i in range(1, STREAMS)]
            whole = [asyncio.ensure_future(http.post("/v1/tts", json=body)) for body in wholes]
            await asyncio.sleep(0.5)  # they reach the ingress and the decoder's slot or queue
            load_started.set()
            results = await asyncio.wait_for(asyncio.gather(*in_flight), 2 * CLIENT_TIMEOUT_S)
            return results, await asyncio.wait_for(asyncio.gather(*whole), 2 * CLIENT_TIMEOUT_S)

    outcome: dict[str, Any] = {}

    def run_load() -> None:
        try:
            outcome["result"] = asyncio.run(load())
        except BaseException as exc:  # re-raised by the test below
            outcome["error"] = exc
        finally:
            load_started.set()
            outcome["ended_at"] = time.monotonic()

    loader = threading.Thread(target=run_load, daemon=True)
    loader.start()
    assert load_started.wait(60), "the long stream sent no audio"
    assert "ended_at" not in outcome, f"the load ended before the node was removed: {outcome}"
    # Ray's Cluster installs signal handlers when it adds a node: that must happen on the main thread.
    removed_at = time.monotonic()
    watch.start()
    cluster.remove_node(worker, allow_graceful=False)  # a crash: no graceful shutdown
    time.sleep(0.5)
    # A stream's bytes arrive from the lost node until it is gone; none can come before the new node joins.
    started_at_removal = [bool(pieces) for pieces in received]
    time.sleep(1.5)  # the node stays gone a while before a new one joins
    add_gpu_worker(cluster)
    node_added = time.monotonic() - removed_at
    loader.join(3 * CLIENT_TIMEOUT_S)
    assert not loader.is_alive(), "the load hung"
    if "error" in outcome:
        raise outcome["error"]
    outcomes, responses = outcome["result"]
    timings = {"node_added": node_added, "all_ended": outcome["ended_at"] - removed_at}

    # Every stream ended: those that had sent nothing complete whole (re-routed), started ones complete or are cut.
    assert not all(started_at_removal), "every stream had audio before the removal: nothing to re-route"
    counts = {"rerouted_complete": 0, "started_complete": 0, "started_cut": 0}
    for index, (started, (status, error)) in enumerate(zip(started_at_removal, outcomes, strict=True)):
        data = b"".join(received[index])
        if not started:
            assert status == 200 and data == expected[index], (index, status, error, len(data))
            counts["rerouted_complete"] += 1
        elif data == expected[index]:
            counts["started_complete"] += 1
        else:  # had started: the cut is the clearest signal a raw stream allows
            assert error is not None and expected[index].startswith(data), (index, status, error, len(data))
            counts["started_cut"] += 1
    # Whole requests: retried once if their replica died, so the same audio, or a clear 503.
    whole_statuses = [response.status_code for response in responses]
    for response, body in zip(responses, expected[STREAMS:], strict=True):
        assert response.status_code in (200, 503), response.text[:300]
        if response.status_code == 200:
            assert response.content == body
        else:
            assert response.headers["retry-after"]

    # The service comes back: /healthz 200 again, one RUNNING decoder replica, on the new node, serving.
    wait_until(lambda: health_status(base_url) == 200, 120, "/healthz to answer 200 again")
    watch.stop.set()
    wait_until(lambda: running_decoders() == 1, 60, "the decoder back at its one replica")
    (new_worker,) = cluster.worker_nodes
    assert decoder_nodes() == [new_worker.node_id]
    replaced_in = time.monotonic() - removed_at
    with httpx.Client(base_url=base_url, timeout=CLIENT_TIMEOUT_S) as http:
        assert http.post("/v1/tts", json=streams[1]).content == expected[1]
    ingress_logs = Path(cluster.head_node.get_logs_dir_path(), "serve").glob(f"replica_{APP}_TTSIngress_*.log")
    resent = sum(path.read_text().count("sending it again") for path in ingress_logs)
    figures = {
        **{key: round(value, 1) for key, value in timings.items()},
        "healthz_down_after_s": None if watch.down_at is None else round(watch.down_at - removed_at, 1),
        "healthz_up_after_s": None if watch.up_at is None else round(watch.up_at - removed_at, 1),
        "replica_back_within_s": round(replaced_in, 1),
        **counts,
        "resent_by_the_ingress": resent,  # the others waited in Serve's queue, which re-routes unstarted calls itself
        "whole_statuses": whole_statuses,
        "streams_ended_after_s": [round(at - removed_at, 1) for at in ended_at],
    }
    print("node loss figures:", figures)
    assert watch.down_at is not None, "/healthz never noticed the lost decoder"
