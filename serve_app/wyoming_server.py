"""The Wyoming listener's Serve deployment: the protocol Home Assistant talks to local text-to-speech engines, on a TCP
port of its own (app args `wyoming`, `cosyvoice-serve run --wyoming-port`; docs/clients.md).

`WyomingServer` is a deployment of one replica that holds the listener (`serve_app.wyoming_listener`, the events it
reads and sends in `serve_app.wyoming_events`) and speaks through the ingress's deployment handle
(`serve_app.wyoming_speech`), so a Wyoming synthesis takes the path, limits and metrics of an HTTP one. It announces
the listener over zeroconf where that package is installed (`serve_app.wyoming_zeroconf`).
"""

from __future__ import annotations

import logging

from ray import serve

from engine.voices.registry import EVERYONE, Caller
from observability import STRUCTURED_LOGGING
from serve_app.guard import keys_configured
from serve_app.replica_args import WyomingArgs
from serve_app.request_args import LimitsArgs, SecurityArgs
from serve_app.wyoming_listener import WyomingListener
from serve_app.wyoming_zeroconf import Announcement

logger = logging.getLogger("ray.serve")

# A client without a key on a server with keys: it sees the shared voices only (no owner, no admin).
KEYLESS = Caller(owner=None, admin=False)


@serve.deployment(name="WyomingServer", num_replicas=1, logging_config=STRUCTURED_LOGGING)
class WyomingServer:
    """The Wyoming listener's replica: one, since one listener holds the port."""

    async def __init__(
        self, settings: WyomingArgs, limits: LimitsArgs, security: SecurityArgs, ingress_deployment: str
    ) -> None:
        assert settings.port is not None  # built only with a port
        keys_on = keys_configured(security)  # the keys of this replica's environment too
        refusal = settings.keyless_refusal(keys_on)
        if refusal is not None:
            raise RuntimeError(refusal)
        self.warnings = settings.serving_warnings(keys_on)
        for warning in self.warnings:
            logger.warning(warning)
        # The ingress's handle by name: the ingress holds this deployment's (its /healthz asks for the warnings).
        ingress = serve.get_deployment_handle(ingress_deployment)
        self.listener = WyomingListener(ingress, KEYLESS if keys_on else EVERYONE, limits)
        await self.listener.start(settings.host, settings.port)
        logger.info("Wyoming listening on %s:%d", settings.host, settings.port)
        self.announcement = await Announcement.start(settings.host, settings.port)

    async def __del__(self) -> None:
        announcement = getattr(self, "announcement", None)  # None also where __init__ failed before it
        if announcement is not None:
            await announcement.close()

    def serving_warnings(self) -> tuple[str, ...]:
        return self.warnings

    def check_health(self) -> None:
        """Serve replaces the replica if its listener has stopped."""
        if not self.listener.serving:
            raise RuntimeError("the Wyoming listener has stopped")
