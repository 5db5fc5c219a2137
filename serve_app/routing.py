"""Which decoder deployment the ingress sends work to, when the optional CPU fallback (`DecoderCPU`) exists.

Rules: `Decoder` while it has a RUNNING replica; else `DecoderCPU` if that has one; else `Decoder`, whose
queued requests make Serve cold-start a replica from 0. The replica counts come from `serve.status()`,
re-read by a background task every `poll_interval_s` (a controller round trip per request would cost more
than the decision is worth); between reads the last decision holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping

from ray import serve
from ray.serve.handle import DeploymentHandle

logger = logging.getLogger("ray.serve")

GPU_DECODER = "Decoder"
CPU_DECODER = "DecoderCPU"


def choose_decoder(running: Mapping[str, int]) -> str:
    """The deployment to route to, from RUNNING replica counts per deployment name."""
    if running.get(GPU_DECODER, 0) > 0:
        return GPU_DECODER
    if running.get(CPU_DECODER, 0) > 0:
        return CPU_DECODER
    return GPU_DECODER


async def running_replicas(app_name: str, names: Iterable[str]) -> dict[str, int]:
    """RUNNING replicas of each named deployment of `app_name` (0 for a name the app does not have)."""
    status = await asyncio.to_thread(serve.status)
    deployments = status.applications[app_name].deployments
    return {name: deployments[name].replica_states.get("RUNNING", 0) if name in deployments else 0 for name in names}


class DecoderRouter:
    """Holds the decoder handles and the current routing decision; `start()` begins the polling task."""

    def __init__(self, handles: Mapping[str, DeploymentHandle], poll_interval_s: float) -> None:
        self.handles = dict(handles)
        self.poll_interval_s = poll_interval_s
        self.choice = GPU_DECODER
        self.running: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self, app_name: str) -> None:
        """Poll from the running event loop; nothing to poll with a single decoder deployment."""
        if len(self.handles) > 1:
            self._task = asyncio.get_running_loop().create_task(self._poll(app_name))

    async def refresh(self, app_name: str) -> None:
        self.running = await running_replicas(app_name, self.handles)
        choice = choose_decoder(self.running)
        if choice != self.choice:
            logger.info("routing decoder work to %s (running replicas: %s)", choice, self.running)
        self.choice = choice

    async def _poll(self, app_name: str) -> None:
        while True:
            try:
                await self.refresh(app_name)
            except Exception as exc:  # a failed status read keeps the last decision; polling goes on
                logger.warning("could not read the decoder replica counts: %s", exc)
            await asyncio.sleep(self.poll_interval_s)

    def handle(self) -> DeploymentHandle:
        return self.handles[self.choice]
