"""The CPU replicas' sections of the app args (`serve_app.args`): the encoders, the text front end, the ingress and
the Wyoming listener."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field, model_validator

from serve_app.args_base import ReplicaArgs, StrictArgs, inherited
from serve_app.exposure import is_loopback

# The encoders' Serve autoscaling timing, fixed: a short up delay (a burst must not wait at the encoders while the
# decoders idle), a long down delay, and Serve's look-back and report interval for requests that take ~0.1 s.
ENCODER_SCALING_TIMING = {
    "upscale_delay_s": 5.0,
    "downscale_delay_s": 300.0,
    "look_back_period_s": 10.0,
    "metrics_interval_s": 2.0,
}


class EncoderAutoscalingArgs(StrictArgs):
    """Serve's built-in policy on the encoders' ongoing + queued requests (the fields are Serve's
    `autoscaling_config` keys; its timing is `ENCODER_SCALING_TIMING`)."""

    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {
        name: f"fixed at {value:g} s (serve_app.replica_args.ENCODER_SCALING_TIMING); to tune it anyway, give the "
        "Encoder an autoscaling_config in the Serve config's `deployments:` section, which overrides the app's"
        for name, value in ENCODER_SCALING_TIMING.items()
    } | {"initial_replicas": "the encoders start at min_replicas (Serve's own default)"}

    min_replicas: int = Field(1, ge=1, description="the fewest encoder replicas")
    max_replicas: int = Field(16, ge=1, description="the most encoder replicas")
    target_ongoing_requests: float = Field(2.0, gt=0, description="per replica; the text encoder runs ~1 at a time")

    @model_validator(mode="after")
    def _bounds(self) -> EncoderAutoscalingArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self

    def serve_config(self) -> dict[str, Any]:
        """The Encoder deployment's Serve `autoscaling_config`."""
        return self.model_dump() | ENCODER_SCALING_TIMING


class EncoderArgs(ReplicaArgs):
    """CPU replicas: frontend, text encoder, voice features."""

    num_replicas: int = Field(1, ge=1, description="fixed replica count, when `autoscaling` is not set")
    autoscaling: EncoderAutoscalingArgs | None = Field(None, description="None: `num_replicas` fixed")
    int8: bool = Field(False, description="INT8 dynamic quantization of the text encoder's Linear layers")


class TextArgs(StrictArgs):
    """The text front end (on the encoder replicas)."""

    spell_out_languages: bool = Field(
        True,
        description="numbers, dates, units and currencies read in the text's own language for the model's languages "
        "beyond Chinese and English (CosyVoice3: de, es, fr, it, ru, ja, ko; v1, v2: ja, ko), the language a request "
        "names or each sentence's, detected; off: every text takes the official Chinese/English front end",
    )


WYOMING_NUM_CPUS = 0.1


class WyomingArgs(StrictArgs):
    """The Wyoming listener: the protocol Home Assistant talks to local text-to-speech engines (docs/clients.md).
    Wyoming has no authentication, so it is off until `port` is set, binds `host` (loopback by default), and a server
    with API keys serves it only with `allow_keyless`. Its replica reserves `WYOMING_NUM_CPUS`: it only relays. It is
    announced by mDNS (`_wyoming._tcp`, as Home Assistant discovers Wyoming services) on the interface it binds, where
    the zeroconf package is installed."""

    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {
        "num_cpus": "fixed at 0.1 (serve_app.replica_args.WYOMING_NUM_CPUS): the listener only relays text and audio",
        "max_connections": "fixed at 16 (serve_app.wyoming_listener.MAX_CONNECTIONS): a Home Assistant holds a few, "
        "and each synthesis is bounded by the ingress's own limits",
        "zeroconf": "always on where the zeroconf package is installed (serve_app.wyoming_zeroconf): the announcement "
        "stays on the interface the listener binds, and Home Assistant discovers Wyoming services by it",
    }

    port: int | None = Field(
        None, ge=1, le=65535, description="its TCP port (Home Assistant's examples use 10200); None: off"
    )
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="the address it binds: loopback by default; 0.0.0.0 for a Home Assistant on another machine "
        "(then anyone who reaches the port may synthesize)",
    )
    allow_keyless: bool = Field(
        False,
        description="serve Wyoming on a server with API keys all the same: its clients send no key, so they use the "
        "built-in speakers, the OpenAI voice names and the shared registered voices, outside the per-key limits",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources the listener's replica needs: one only the node Home Assistant connects to "
        "has",
    )

    @model_validator(mode="after")
    def _package_installed(self) -> WyomingArgs:
        if self.port is not None and importlib.util.find_spec("wyoming") is None:
            raise ValueError("wyoming.port needs the wyoming package: pip install 'cosyvoice-serve[wyoming]'")
        return self

    def keyless_refusal(self, keys_on: bool) -> str | None:
        """Why the listener must not start on a server whose API keys are on (`keys_on`); None where it may."""
        if self.port is None or not keys_on or self.allow_keyless:
            return None
        return (
            "Wyoming has no authentication and this server has API keys: Wyoming clients would synthesize without "
            "one; set wyoming.allow_keyless (cosyvoice-serve run --wyoming-allow-keyless) to serve it anyway, with "
            "the shared voices only"
        )

    def serving_warnings(self, keys_on: bool) -> tuple[str, ...]:
        """What is unsafe in how the listener serves (none while it is off): without keys on a server whose API keys
        are on (`keys_on`), or beyond loopback."""
        if self.port is None:
            return ()
        where = f"Wyoming on {self.host}:{self.port}"
        if keys_on:
            return (
                f"{where} serves clients without an API key (wyoming.allow_keyless): whoever reaches it synthesizes "
                "with the built-in speakers, the OpenAI voice names and the shared voices, outside the per-key limits",
            )
        if not is_loopback(self.host):
            return (
                f"{where}, beyond loopback, has no authentication: anyone who can reach the port synthesizes with "
                "every voice",
            )
        return ()


class IngressArgs(ReplicaArgs):
    """The HTTP ingress replicas (their queue is the HTTP proxy's)."""

    num_replicas: int = Field(1, ge=1, description="ingress replicas (fixed)")
    num_cpus: float = inherited(ReplicaArgs, "num_cpus", 0.25)
    max_ongoing_requests: int = inherited(ReplicaArgs, "max_ongoing_requests", 64)
    max_queued_requests: int | None = inherited(ReplicaArgs, "max_queued_requests", 256)
