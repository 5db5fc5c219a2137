"""The try-it page, `/healthz` and `/v1/models`."""

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.text_relay import TextRelays
from serve_app.api import STATIC_DIR
from serve_app.exposure import exposure_warning
from serve_app.synthesis import Synthesis

logger = logging.getLogger("ray.serve")

HEALTH_MAX_AGE_S = 1.0
# How long /healthz (and a stream that lost its relay) waits for a text relay or the Wyoming listener to answer: a
# live actor answers in milliseconds, so this only bounds the wait on a lost one.
HEALTH_PROBE_TIMEOUT_S = 2.0


class HealthRoutes:
    """The page, the probe and the model list, on the replica's `Synthesis`; `serving_warnings` (what is unsafe in
    how the server runs), the text streams' relays and the Wyoming listener (None: off) are what `/healthz` reports
    beside the replica counts."""

    def __init__(
        self,
        synthesis: Synthesis,
        serving_warnings: tuple[str, ...],
        text_relays: TextRelays,
        wyoming: DeploymentHandle | None = None,
    ) -> None:
        self.synthesis = synthesis
        self.serving_warnings = serving_warnings
        self.text_relays = text_relays
        self.wyoming = wyoming
        self._wyoming_warnings: tuple[str, ...] | None = None

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/", self.page, methods=["GET"], include_in_schema=False)
        router.add_api_route("/favicon.ico", self.favicon, methods=["GET"], include_in_schema=False)
        router.add_api_route("/healthz", self.healthz, methods=["GET"])
        router.add_api_route("/v1/models", self.models, methods=["GET"])
        return router

    async def page(self) -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    async def favicon(self) -> FileResponse:
        return FileResponse(STATIC_DIR / "favicon.svg", media_type="image/svg+xml")

    async def healthz(self) -> JSONResponse:
        """200 while the encoder and a decoder deployment (GPU or its CPU fallback) have a running replica, else 503.

        From the router's view, re-read when older than `HEALTH_MAX_AGE_S` (so a probe sees a replica's death within
        about a second: the view counts only replicas whose actor is alive), else the view it has.
        """
        router = self.synthesis.router
        try:
            await router.refresh_if_older(serve.get_replica_context().app_name, HEALTH_MAX_AGE_S)
        except Exception as exc:  # the last view stands
            logger.warning("could not re-read the replica counts for /healthz: %s", exc)
        ready = router.ready()
        relay_problem = await self.text_relays.problem(HEALTH_PROBE_TIMEOUT_S)
        exposed = await asyncio.to_thread(exposure_warning)  # read afresh: replicas come and go (~10 ms)
        polled_at = router.polled_at
        body = {
            "status": "unavailable" if not ready else "degraded" if relay_problem else "ok",
            "running_replicas": router.running,
            "checked_s_ago": None if polled_at is None else round(time.monotonic() - polled_at, 3),
            # serving beyond loopback without API keys, Ray's ports on every interface, a lost text relay, Wyoming's
            "warnings": [
                *self.serving_warnings,
                *(warning for warning in (exposed, relay_problem) if warning),
                *await self.wyoming_warnings(),
            ],
        }
        return JSONResponse(body, status_code=200 if ready and not relay_problem else 503)

    async def wyoming_warnings(self) -> tuple[str, ...]:
        """The Wyoming listener's warnings (none where it is off), asked once: they hold for its life; while it does not
        answer, one that says so."""
        if self.wyoming is None:
            return ()
        if self._wyoming_warnings is None:
            try:
                answer = self.wyoming.serving_warnings.remote()
                self._wyoming_warnings = await asyncio.wait_for(answer, HEALTH_PROBE_TIMEOUT_S)
            except Exception as exc:
                return (f"the Wyoming listener does not answer ({type(exc).__name__}): see the WyomingServer's log",)
        return self._wyoming_warnings

    async def models(self) -> dict[str, Any]:
        """The served model, then OpenAI's model names (`OPENAI_TTS_MODELS`): `model` may be any of them; each says
        which LLM checkpoint the model runs (None: dummy weights)."""
        checkpoint = (await self.synthesis.model_info()).llm_checkpoint
        data = [
            {"id": name, "object": "model", "owned_by": "cosyvoice-serve", "llm_checkpoint": checkpoint}
            for name in self.synthesis.model_names
        ]
        return {"object": "list", "data": data}
