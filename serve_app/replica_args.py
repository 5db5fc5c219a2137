"""The CPU replicas' sections of the app args (`serve_app.args`): the encoders, the text front end and the Wyoming
listener."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import ClassVar

from pydantic import Field, model_validator

from serve_app.args_base import StrictArgs
from serve_app.deployment_options import ENCODER, WYOMING, moved_to_deployment
from serve_app.exposure import is_loopback


class EncoderArgs(StrictArgs):
    """CPU replicas: frontend, text encoder, voice features (their replicas and CPUs: deployment `Encoder`)."""

    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {
        "num_cpus": moved_to_deployment("ray_actor_options: {num_cpus: ...}", ENCODER),
        "max_ongoing_requests": moved_to_deployment("max_ongoing_requests", ENCODER),
        "max_queued_requests": moved_to_deployment("max_queued_requests", ENCODER),
        "num_replicas": moved_to_deployment("num_replicas", ENCODER),
        "autoscaling": moved_to_deployment(
            "autoscaling_config: {min_replicas, max_replicas, target_ongoing_requests, ...}", ENCODER
        ),
        "resources": moved_to_deployment("ray_actor_options: {num_cpus: ..., resources: {...}}", ENCODER),
    }

    int8: bool = Field(False, description="INT8 dynamic quantization of the text encoder's Linear layers")


class TextArgs(StrictArgs):
    """The text front end (on the encoder replicas)."""

    spell_out_languages: bool = Field(
        True,
        description="numbers, dates, units and currencies read in the text's own language for the model's languages "
        "beyond Chinese and English (CosyVoice3: de, es, fr, it, ru, ja, ko; v1, v2: ja, ko), the language a request "
        "names or each sentence's, detected; off: every text takes the official Chinese/English front end",
    )


class WyomingArgs(StrictArgs):
    """The Wyoming listener: the protocol Home Assistant talks to local text-to-speech engines (docs/clients.md).
    Wyoming has no authentication, so it is off until `port` is set, binds `host` (loopback by default), and a server
    with API keys serves it only with `allow_keyless`. It is announced by mDNS (`_wyoming._tcp`, as Home Assistant
    discovers Wyoming services) on the interface it binds, where the zeroconf package is installed. Its replica's
    options: deployment `WyomingServer`."""

    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {
        "num_cpus": moved_to_deployment("ray_actor_options: {num_cpus: ...}", WYOMING),
        "resources": moved_to_deployment("ray_actor_options: {num_cpus: ..., resources: {...}}", WYOMING),
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
