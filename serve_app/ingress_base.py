"""What every route group of the ingress shares: its setup (API keys, body limits, tenancy, the decoder router), the
model's info, and calls to the other deployments."""

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from autoscaling.policy import RayWakeBoard, ScalingRules, WakeRule
from deployments.text_relay import TextRelays
from serve_app.errors import REPLICA_LOST, SERVE_UNAVAILABLE, unavailable_error
from serve_app.guard import (
    BodyTimeouts,
    GuardSettings,
    browser_rules,
    configure_guard,
    load_api_keys,
    load_keys,
    serving_warnings,
)
from serve_app.request_args import AudioArgs, LimitsArgs, OpenAIArgs, SecurityArgs
from serve_app.routing import CPU_DECODER, GPU_DECODER, DecoderRouter
from serve_app.tenancy import TenancySettings, configure_tenancy

logger = logging.getLogger("ray.serve")

VOICES_PATH = "/v1/voices"
# Room for the multipart framing and the text fields around the audio of a voice upload (POST /v1/voices).
UPLOAD_FORM_OVERHEAD_BYTES = 64 << 10


def serve_http_host() -> str | None:
    """The host Serve's HTTP proxies bind (`http_options.host`), from the controller; None where it is unknown."""
    try:
        # Ray 2.60 has no public getter for it; serve.status() goes through the same client.
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.host
    except Exception as exc:
        logger.warning("could not read Serve's HTTP host (%s): Host checks accept the loopback names only", exc)
        return None


class IngressBase:
    """The ingress replica's state; the route groups (health, voices, OpenAI, native) are its subclasses, and
    `serve_app.ingress.IngressRoutes` is all of them."""

    def __init__(
        self,
        encoder: DeploymentHandle,
        decoder: DeploymentHandle,
        model_name: str,
        limits: LimitsArgs,
        security: SecurityArgs | None = None,
        openai: OpenAIArgs | None = None,
        audio: AudioArgs | None = None,
        decoder_cpu: DeploymentHandle | None = None,
        routing_poll_s: float = 2.0,
        gpu_rules: ScalingRules | None = None,
        wake: WakeRule | None = None,
        wyoming: DeploymentHandle | None = None,
    ):
        self.encoder = encoder
        self.model_name = model_name
        self.openai = openai or OpenAIArgs()
        self.audio = audio or AudioArgs()
        self.model_names = (model_name, *(alias for alias in self.openai.model_aliases if alias != model_name))
        self.limits = limits
        self._info: dict[str, Any] | None = None
        upload_limit = max(limits.max_body_bytes, limits.max_prompt_audio_bytes + UPLOAD_FORM_OVERHEAD_BYTES)
        security = security or SecurityArgs()
        keys = load_api_keys(security)
        admin_keys = load_keys(security.admin_keys, security.admin_keys_env)
        keys_on = bool(keys + admin_keys)
        bound_host = serve_http_host()
        self.serving_warnings = serving_warnings(security, bound_host, keys_on)
        for warning in self.serving_warnings:
            logger.warning(warning)
        configure_guard(
            GuardSettings(
                keys + admin_keys,
                limits.max_body_bytes,
                {VOICES_PATH: upload_limit},
                body_timeouts=BodyTimeouts(limits.body_read_timeout_s, limits.body_read_deadline_s),
                browser=browser_rules(security, bound_host, keys_on),
            )
        )
        configure_tenancy(
            TenancySettings(
                keys_on=keys_on,
                admin_keys=admin_keys,
                max_concurrent_requests_per_key=limits.max_concurrent_requests_per_key,
                retry_after_s=limits.retry_after_s,
            )
        )
        decoders = {GPU_DECODER: decoder} | ({} if decoder_cpu is None else {CPU_DECODER: decoder_cpu})
        self.router = DecoderRouter(decoders, routing_poll_s, gpu_rules, RayWakeBoard() if wake else None)
        self.router.start(serve.get_replica_context().app_name)
        self.text_relays = TextRelays()  # the text streams' relay to the decoders (CosyVoice2/3)
        self.wyoming = wyoming  # the Wyoming listener (app args `wyoming`), if it is on
        self._wyoming_warnings: tuple[str, ...] | None = None

    async def model_info(self) -> dict[str, Any]:
        """Voices and sample rate, asked once from an encoder replica."""
        if self._info is None:
            self._info = await self.call(self.encoder.info.remote)
        return self._info

    @staticmethod
    async def call(make_call: Callable[[], Awaitable[Any]]) -> Any:
        """Await a call to another deployment, retried once if its replica died or its result was lost with the
        replica's node (decodes are seeded, so the retry gives the same audio); Serve's overload errors become JSON
        503s."""
        try:
            try:
                return await make_call()
            except REPLICA_LOST as exc:
                logger.warning("a replica died during a call (%s); retrying it once", type(exc).__name__)
                return await make_call()
        except (*REPLICA_LOST, *SERVE_UNAVAILABLE) as exc:  # the retry failed too, or overload: 503
            raise unavailable_error(exc) from exc
