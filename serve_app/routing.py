"""Which decoder deployment the ingress sends work to, and the cached replica counts behind it (and /healthz).

The rule is `autoscaling.policy.use_cpu_fallback`: while the GPU decoder's schedule floor is 0 and the CPU
fallback (`DecoderCPU`) runs, work goes to the fallback, so the GPU replicas drain before their policy
scales them to 0 and no queued request cold-starts one; otherwise `Decoder` while it has a RUNNING
replica, else `DecoderCPU` if that has one, else `Decoder` (Serve cold-starts a replica from 0).
While the CPU fallback's policy marks the GPU decoder woken (`autoscaling.policy.WakeRule`, on the `WakeBoard`), the
GPU decoder is not drained: new work goes to it once it runs (requests already at the fallback finish there).
The RUNNING counts come from `serve.status()` and the live replica actors (the wake mark from the board). With a
fallback, a background task re-reads them every `ROUTING_POLL_S` (a controller round trip per request would cost
more than it is worth); between reads the last view holds. Without one there is no choice to make, so nothing polls
(a read holds the ingress' GIL for ~28 ms on 2 cores): /healthz re-reads a view older than a second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from autoscaling.policy import ScalingRules, WakeBoard, gpu_draining, use_cpu_fallback

logger = logging.getLogger("ray.serve")

GPU_DECODER = "Decoder"
CPU_DECODER = "DecoderCPU"
ENCODER = "Encoder"


def choose_decoder(running: Mapping[str, int], draining: bool = False) -> str:
    """The deployment to route to, from RUNNING replica counts per deployment name."""
    fallback = use_cpu_fallback(running.get(GPU_DECODER, 0), running.get(CPU_DECODER, 0), draining)
    return CPU_DECODER if fallback else GPU_DECODER


async def running_replicas(app_name: str, names: Iterable[str]) -> dict[str, int]:
    """RUNNING replicas of each named deployment of `app_name` (0 for a name the app does not have), not counting
    those whose actor is gone: Serve's controller notices a dead replica only at its next health check (~10 s),
    while a dead actor leaves Ray's named actors at once."""
    status, actors = await asyncio.gather(
        asyncio.to_thread(serve.status), asyncio.to_thread(live_replica_actors, app_name)
    )
    deployments = status.applications[app_name].deployments
    return {
        name: min(deployments[name].replica_states.get("RUNNING", 0), actors[name]) if name in deployments else 0
        for name in names
    }


def live_replica_actors(app_name: str) -> Counter[str]:
    """Live replica actors of each deployment of `app_name`, by Serve's actor names (SERVE_REPLICA::app#name#id)."""
    prefix = f"SERVE_REPLICA::{app_name}#"
    names = (actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True))
    return Counter(name[len(prefix) :].split("#")[0] for name in names if name.startswith(prefix))


# How often the ingress re-reads the replica counts while a CPU fallback runs: a read holds the ingress's GIL for ~28 ms
# on 2 cores (~1.4% of it at this rate), and replicas start and drain in tens of seconds, so a view 2 s old routes as
# well as a fresh one.
ROUTING_POLL_S = 2.0


class DecoderRouter:
    """Holds the decoder handles, the last polled RUNNING counts (encoder included) and the routing decision.

    `gpu_rules`: the GPU decoder's autoscaling rules, whose schedule says when to drain it (None: never);
    `wake_board`: where the fallback's policy marks the GPU decoder woken (None: the wake rule is off).
    """

    def __init__(
        self,
        handles: Mapping[str, DeploymentHandle],
        poll_interval_s: float,
        gpu_rules: ScalingRules | None = None,
        wake_board: WakeBoard | None = None,
    ) -> None:
        self.handles = dict(handles)
        self.poll_interval_s = poll_interval_s
        self.gpu_rules = gpu_rules
        self.wake_board = wake_board
        self.woken_until = 0.0
        self.choice = GPU_DECODER
        self.running: dict[str, int] = {}
        self.polled_at: float | None = None  # time.monotonic() of the last successful read
        self._task: asyncio.Task[None] | None = None

    def start(self, app_name: str) -> None:
        """Poll from the running event loop while there is a choice to make (a CPU fallback)."""
        if CPU_DECODER in self.handles:
            self._task = asyncio.get_running_loop().create_task(self._poll(app_name))

    async def refresh(self, app_name: str) -> None:
        self.running = await running_replicas(app_name, (ENCODER, *self.handles))
        if self.wake_board is not None:
            self.woken_until = await asyncio.to_thread(self.wake_board.woken_until, app_name)
        self.polled_at = time.monotonic()
        choice = GPU_DECODER
        if CPU_DECODER in self.handles:
            draining = gpu_draining(self.gpu_rules, time.time(), woken_until=self.woken_until)
            choice = choose_decoder(self.running, draining)
        if choice != self.choice:
            logger.info("routing decoder work to %s (running replicas: %s)", choice, self.running)
        self.choice = choice

    async def refresh_if_older(self, app_name: str, max_age_s: float) -> None:
        """Re-read now unless the view is at most `max_age_s` old (bounds the reads a caller can cause)."""
        if self.polled_at is None or time.monotonic() - self.polled_at > max_age_s:
            await self.refresh(app_name)

    async def _poll(self, app_name: str) -> None:
        while True:
            try:
                await self.refresh(app_name)
            except Exception as exc:  # a failed status read keeps the last view; polling goes on
                logger.warning("could not read the replica counts: %s", exc)
            await asyncio.sleep(self.poll_interval_s)

    def ready(self) -> bool:
        """The last view has a running encoder and a running decoder deployment (GPU or fallback)."""
        return self.running.get(ENCODER, 0) > 0 and any(self.running.get(name, 0) for name in self.handles)

    def handle(self) -> DeploymentHandle:
        return self.handles[self.choice]
