"""Typed arguments of the application builder (`serve_app:build_app`), as given in a Serve config's `args`."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic.fields import FieldInfo

from autoscaling.policy import ScalingRules, WakeRule, decoder_autoscaling_config
from autoscaling.schedule import Schedule
from engine.errors import CheckpointError
from engine.loading.loader import PRESET_VOICE_MODELS, PRESETS
from engine.loading.model_source import LLM_CHECKPOINT_AUTO, hub_model
from engine.nn.precision import AUTO_INT4_DTYPE
from engine.runtime.playback import DeadlinePolicy, FcfsPolicy, SchedulingPolicy
from engine.voices.cloning import MAX_PROMPT_CHANNELS, MAX_PROMPT_SECONDS, PROMPT_SAMPLE_RATES
from engine.voices.registry import provisioned_voice_id
from engine.voices.store import is_store_url
from serve_app.exposure import is_loopback

logger = logging.getLogger("ray.serve")


class _Strict(BaseModel):
    # Inputs stay out of error messages: they may hold API keys.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    # Fields this section had and no longer has: name -> what replaced it, or why it went. A config that still sets
    # one is refused with that message rather than pydantic's bare "extra inputs are not permitted".
    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            removed = [f"{name} was removed: {cls.REMOVED_FIELDS[name]}" for name in cls.REMOVED_FIELDS if name in data]
            if removed:
                raise ValueError("; ".join(removed))
        return data


QUEUE_DESCRIPTION = "requests waiting for a replica beyond this are answered 503 + Retry-After; None: unbounded"


CPU_RESOURCES_MOVED = "cpu_resources (a top-level field) places every CPU replica: ingress, encoders, CPU fallback"
CPU_REPLICA_SECTIONS = ("ingress", "encoder", "decoder_cpu")


class ReplicaArgs(_Strict):
    """The Serve options every request-serving deployment has (where a replica may run: `AppArgs.cpu_resources`)."""

    REMOVED_FIELDS = {"resources": CPU_RESOURCES_MOVED}

    num_cpus: float = Field(0.5, gt=0, description="CPUs Ray reserves for each replica")
    max_ongoing_requests: int = Field(8, ge=1, description="requests one replica takes at once (Serve's)")
    max_queued_requests: int | None = Field(64, ge=1, description=QUEUE_DESCRIPTION)


def inherited(base: type[BaseModel], name: str, default: Any) -> Any:
    """`base`'s field `name` with another default: its constraints and description stay the base's (one
    documentation for every replica kind)."""
    return FieldInfo.merge_field_infos(base.model_fields[name], default=default)


# The encoders' Serve autoscaling timing, fixed: a short up delay (a burst must not wait at the encoders while the
# decoders idle), a long down delay, and Serve's look-back and report interval for requests that take ~0.1 s.
ENCODER_SCALING_TIMING = {
    "upscale_delay_s": 5.0,
    "downscale_delay_s": 300.0,
    "look_back_period_s": 10.0,
    "metrics_interval_s": 2.0,
}


class EncoderAutoscalingArgs(_Strict):
    """Serve's built-in policy on the encoders' ongoing + queued requests (the fields are Serve's
    `autoscaling_config` keys; its timing is `ENCODER_SCALING_TIMING`)."""

    REMOVED_FIELDS = {
        name: f"fixed at {value:g} s (serve_app.args.ENCODER_SCALING_TIMING); to tune it anyway, give the Encoder an "
        "autoscaling_config in the Serve config's `deployments:` section, which overrides the app's"
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


class DecoderAutoscalingArgs(_Strict):
    """The decoder policy (`autoscaling.policy.DecoderAutoscalingPolicy`) and how often replicas report to it."""

    rules: ScalingRules = Field(
        default_factory=ScalingRules,
        description="thresholds, windows, cooldowns, min/max_replicas, schedule (autoscaling.policy.ScalingRules)",
    )
    look_back_period_s: float = Field(30.0, gt=0, description="Serve averages each replica metric over this")
    metrics_interval_s: float = Field(10.0, gt=0, description="how often replicas push their metrics")

    def serve_config(self, wake: WakeRule | None = None) -> dict[str, Any]:
        """The GPU decoder deployment's Serve `autoscaling_config` (woken under `wake`, see `AppArgs.wake_rule`)."""
        return decoder_autoscaling_config(self.rules, self.look_back_period_s, self.metrics_interval_s, wake)


class EncoderArgs(ReplicaArgs):
    """CPU replicas: frontend, text encoder, voice features."""

    num_replicas: int = Field(1, ge=1, description="fixed replica count, when `autoscaling` is not set")
    autoscaling: EncoderAutoscalingArgs | None = Field(None, description="None: `num_replicas` fixed")
    int8: bool = Field(False, description="INT8 dynamic quantization of the text encoder's Linear layers")


class TextArgs(_Strict):
    """The text front end (on the encoder replicas)."""

    spell_out_languages: bool = Field(
        True,
        description="numbers, dates, units and currencies read in the text's own language for the model's languages "
        "beyond Chinese and English (CosyVoice3: de, es, fr, it, ru, ja, ko; v1, v2: ja, ko), the language a request "
        "names or each sentence's, detected; off: every text takes the official Chinese/English front end",
    )


class DecoderArgs(ReplicaArgs):
    """Speech-token LM + flow + vocoder replicas; a GPU fraction each, or CPU with num_gpus 0."""

    num_replicas: int = Field(1, ge=1, description="fixed replica count, when `autoscaling` is not set")
    autoscaling: DecoderAutoscalingArgs | None = Field(None, description="None: `num_replicas` fixed")
    num_gpus: float = Field(0.0, ge=0, le=1, description="GPU fraction per replica; 0 runs on CPU")
    dtype: Literal["auto", "auto-int4", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="auto: on a GPU float16 (CosyVoice3: bfloat16 LLM and flow); on CPU per stage for the CPU and "
        "the model (engine.nn.precision.cpu_auto_choice: INT8 LLM, bfloat16 flow with AMX or AVX512-BF16, float32 "
        "vocoder; float32 throughout for the tiny models); auto-int4 (CPU only): auto with the LLM's Linear weights "
        "in INT4 (faster batch-1 steps, slower from batch 8: docs/performance.md); the choice and why are logged at "
        "startup and in batch_stats",
    )
    max_batch_size: int = Field(
        8,
        ge=1,
        description="sentences decoding at once in a replica's loop (LLM batch), at most (the memory budget may "
        "admit fewer); 8 for the tiny model on CPU, whose LLM step keeps 16 streams 5x faster than real time and "
        "whose flow + vocoder lanes make ~11 audio seconds a second (docs/performance.md)",
    )
    batch_wait_timeout_s: float = Field(
        0.05,
        ge=0,
        description="how long an admission batch of whole requests waits to fill while the loop is busy (an idle "
        "loop admits at once; streams never wait: the loop takes them in at its next step)",
    )
    max_concurrent_batches: int = Field(
        2, ge=1, description="admission batches handed to the loop at once: one forming never waits for another"
    )
    max_vocode_batch: int | None = Field(
        None,
        ge=1,
        description="flow + vocoder batch: whole sentences, or streams whose new tokens it takes in, per job (a job "
        "runs to its end, so this also bounds how long a new request's first chunk waits); None: 8 on a GPU, 1 on "
        "CPU",
    )
    max_ongoing_requests: int | None = Field(  # type: ignore[assignment]  # None: derived from the batches
        None, ge=1, description="default: 2 x max_batch_size x max_concurrent_batches (batches must be able to fill)"
    )
    memory_budget_gb: Annotated[float, Field(gt=0)] | Literal["auto"] | None = Field(
        "auto",
        description="device memory a replica's live requests may use for activations, each counted by its own "
        "length; a request that needs more than all of it is refused with 413. auto: on a GPU, the replica's share "
        "of the card (num_gpus) less its weights and a reserve (a tenth, at least 256 MiB); on CPU what the "
        "container's memory limit (else the host's memory) leaves at start, less the same reserve. None: no byte bound",
    )
    prompt_cache_share: float = Field(
        0.1,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="share of a decoder replica's memory budget its cache of prepared voice prompts may hold (the "
        "LLM's KV cache over each cloned voice's prompt prefix, the flow's prompt tensors; counted in the budget and "
        "given back to live requests that need it); 256 MiB when the replica has no budget; 0: no cache",
    )
    mps_thread_share: bool = Field(
        False,
        description="under CUDA MPS (docs/gpu_sharing.md), hold each replica to its num_gpus share of the GPU's SMs: "
        "its process gets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 x num_gpus (0.25: 25) before CUDA starts. Off: each "
        "replica's kernels may use every SM, which MPS still runs beside the other replicas'",
    )

    @model_validator(mode="after")
    def _mps_needs_a_gpu(self) -> DecoderArgs:
        if self.mps_thread_share and not self.num_gpus:
            raise ValueError("mps_thread_share holds a replica to its GPU share: it needs num_gpus > 0")
        if self.dtype == AUTO_INT4_DTYPE and self.num_gpus:
            raise ValueError(f"dtype {AUTO_INT4_DTYPE} is for CPU decoders (num_gpus 0); use auto on a GPU")
        return self

    @property
    def mps_env(self) -> dict[str, str]:
        """The environment a replica's process starts with for `mps_thread_share` (empty when off)."""
        if not self.mps_thread_share:
            return {}
        return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, round(self.num_gpus * 100)))}

    @model_validator(mode="after")
    def _batches_can_fill(self) -> DecoderArgs:
        needed = self.max_batch_size * self.max_concurrent_batches
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < needed:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) must be >= max_batch_size x "
                f"max_concurrent_batches ({needed}), or batches never fill"
            )
        return self

    @property
    def ongoing_requests_limit(self) -> int:
        return self.max_ongoing_requests or 2 * self.max_batch_size * self.max_concurrent_batches


class SchedulerArgs(_Strict):
    """The order of every decoder replica's loop (engine.runtime.playback, docs/scheduler.md)."""

    policy: Literal["deadline", "fcfs"] = Field(
        "deadline",
        description="deadline: earliest playback deadline first, streams with slack paused for earlier deadlines; "
        "fcfs: a running request's next sentence first, then the oldest new request (the order before deadlines)",
    )
    target_first_audio_s: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="a new stream's deadline for its first audio, after its arrival in the decoder (on CPU the tiny "
        "model's idle time to first audio is ~0.6 s, the real-size model's ~5 s: there the deadline orders, it "
        "cannot be met)",
    )
    whole_deadline_factor: float = Field(
        2.0,
        ge=0,
        allow_inf_nan=False,
        description="a whole request's deadline: its arrival + this x its estimated audio length (0.3 s per text "
        "token)",
    )

    # Tuned by measurement, not a deployment's choice (docs/performance.md, the late-short-stream runs on 2 CPU cores):
    # the loop keeps engine.runtime.playback.DeadlinePolicy's 1 s for each.
    REMOVED_FIELDS = {
        "first_audio_hold_s": "fixed at the measured best, 1 s (a late short stream's median time to first audio "
        "0.40 s, against 0.56 s without a hold and 0.50 s with 2 s: docs/history/performance-runs.md)",
        "min_preempt_slack_s": "fixed at 1 s, lowered from 2 s by measurement (docs/history/performance-runs.md)",
        "first_audio_passover_s": "fixed at 1 s: 0.5 s made no difference beyond noise "
        "(docs/history/performance-runs.md, runs 30-31)",
    }

    def decoder_policy(self) -> SchedulingPolicy:
        """The policy every decoder replica's loop orders its work by."""
        if self.policy == "fcfs":
            return FcfsPolicy()
        return DeadlinePolicy(
            target_first_audio_s=self.target_first_audio_s, whole_deadline_factor=self.whole_deadline_factor
        )


# Tokens an input may have per character of `max_input_chars` (the model's tokenizer on the text as sent): Chinese
# takes ~1.1 a character, English ~0.25, emoji 2 and rare scripts up to 4, so a text of emoji or rare script is
# refused before its length in characters would be.
TOKENS_PER_INPUT_CHAR = 1.5


class LimitsArgs(_Strict):
    REMOVED_FIELDS = {
        "health_timeout_s": "the health probes wait a fixed 2 s for a stage to answer "
        "(serve_app.health_routes.HEALTH_PROBE_TIMEOUT_S): a live one answers in milliseconds",
        "max_input_tokens": f"derived: {TOKENS_PER_INPUT_CHAR:g} x max_input_chars (LimitsArgs.max_input_tokens)",
        "max_prompt_audio_channels": f"the speech tokenizer's bound, {MAX_PROMPT_CHANNELS} "
        "(engine.voices.cloning.MAX_PROMPT_CHANNELS)",
    }

    max_input_chars: int = Field(4096, ge=1, description="longer inputs are rejected with 400")
    long_text_chars: int = Field(300, ge=1, description="inputs longer than this take the streaming path")
    max_body_bytes: int = Field(1 << 20, ge=1, description="larger request bodies are rejected with 413")
    body_read_timeout_s: float = Field(
        10.0,
        gt=0,
        description="the longest wait for the next piece of a request body; a client that stalls longer gets 408 "
        "and its connection is closed, freeing its ingress slot",
    )
    body_read_deadline_s: float = Field(
        120.0, gt=0, description="the whole body must arrive within this (a client that trickles it in gets 408 too)"
    )
    max_stream_s: float = Field(
        300.0,
        gt=0,
        description="wall-clock seconds one decoder call (a stream, or a sentence of a whole request) may take from "
        "its arrival at the decoder; past it, it ends with 413 and frees its slot",
    )
    max_audio_s: float = Field(
        600.0,
        gt=0,
        description="seconds of speech one decoder call (a stream, or a sentence of a whole request) may make; past "
        "it, it ends with 413 and frees its slot (sampling.max_token_text_ratio also bounds it per text length)",
    )
    retry_after_s: float = Field(1.0, ge=0, description="the Retry-After of 503 answers (overload, replica lost)")
    reroute_s: float = Field(
        30.0,
        ge=0,
        description="a stream whose decoder replica is lost before its first audio is sent again (to another replica "
        "or the replacement) for up to this long, then answered 503 + Retry-After",
    )
    # Voice registration (POST /v1/voices): the uploaded prompt recording and the registry.
    max_prompt_audio_bytes: int = Field(
        10 << 20, ge=1, description="larger voice uploads are rejected with 413, before decoding"
    )
    max_prompt_audio_s: float = Field(
        MAX_PROMPT_SECONDS,
        gt=0,
        le=MAX_PROMPT_SECONDS,
        description="longer prompt recordings are rejected with 400 (at most 30 s: the speech tokenizer's limit)",
    )
    min_prompt_audio_s: float = Field(1.0, ge=0, description="shorter prompt recordings are rejected with 400")
    prompt_audio_sample_rates: tuple[int, ...] = Field(
        PROMPT_SAMPLE_RATES,
        min_length=1,
        description="the sample rates (Hz) a prompt recording may have, others are rejected with 400; some of "
        f"{', '.join(map(str, PROMPT_SAMPLE_RATES))} (each resamples to the models' rates in bounded memory)",
    )
    max_voices: int = Field(100, ge=1, description="registered voices at most; past it, registering answers 409")
    max_voices_per_key: int | None = Field(
        20,
        ge=1,
        description="with API keys on, registered voices one key may own (shared ones count for none); past it, "
        "registering answers 409; None: only max_voices",
    )
    text_stream_idle_s: float = Field(
        60.0,
        gt=0,
        description="a text stream (/v1/audio/speech/stream) that sends no text to speak for this long while it has "
        "no audio in the making ends with an error event (408), freeing its ingress slot, whatever else it sends "
        "(flush with nothing to speak, empty text)",
    )
    max_text_streams: int | None = Field(
        None,
        ge=1,
        description="text streams one ingress replica holds at once; one more is refused at its handshake with 503 "
        "(1013 where the handshake cannot be answered). Below ingress.max_ongoing_requests, so that sockets never "
        "take the slots plain requests need; None: half of them (32 of the default 64)",
    )
    max_text_streams_per_key: int | None = Field(
        None,
        ge=1,
        description="with API keys on, text streams one key may hold at once in one ingress replica (one more: 503); "
        "below max_concurrent_requests_per_key, which counts them too; None: half of that (4 of the default 8), or "
        "no bound of its own where that is None",
    )
    max_concurrent_requests_per_key: int | None = Field(
        8,
        ge=1,
        description="with API keys on, requests one key may have in flight in one ingress replica (a stream until "
        "its end); more: 429 + Retry-After; None: no limit",
    )

    @property
    def max_input_tokens(self) -> int:
        """Inputs with more tokens (a CosyVoice2/3 text stream's pieces in all, a v1 one's each sentence) are refused
        with 413 before anything else is done with them."""
        return int(TOKENS_PER_INPUT_CHAR * self.max_input_chars)

    @model_validator(mode="after")
    def _prompt_rates_are_supported(self) -> LimitsArgs:
        unsupported = sorted(set(self.prompt_audio_sample_rates) - set(PROMPT_SAMPLE_RATES))
        if unsupported:
            raise ValueError(
                f"prompt_audio_sample_rates: {unsupported} Hz not supported; choose from {list(PROMPT_SAMPLE_RATES)}"
            )
        return self


WYOMING_NUM_CPUS = 0.1


class WyomingArgs(_Strict):
    """The Wyoming listener: the protocol Home Assistant talks to local text-to-speech engines (docs/clients.md).
    Wyoming has no authentication, so it is off until `port` is set, binds `host` (loopback by default), and a server
    with API keys serves it only with `allow_keyless`. Its replica reserves `WYOMING_NUM_CPUS`: it only relays."""

    REMOVED_FIELDS = {
        "num_cpus": "fixed at 0.1 (serve_app.args.WYOMING_NUM_CPUS): the listener only relays text and audio"
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
    max_connections: int = Field(
        16, ge=1, description="connections held at once; one more gets an error event and is closed"
    )
    zeroconf: bool = Field(
        True,
        description="announce the listener by mDNS (`_wyoming._tcp`), as Home Assistant discovers Wyoming services, "
        "on the interface it binds (loopback: this machine only), where the zeroconf package is installed",
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


class CpuFallbackArgs(ReplicaArgs):
    """The optional `DecoderCPU` deployment: the Decoder on CPU (fp32), up while the GPU decoders may be at 0."""

    REMOVED_FIELDS = {
        "batch_wait_timeout_s": "the fallback waits decoder.batch_wait_timeout_s, as the GPU decoder does",
        "resources": CPU_RESOURCES_MOVED,
        "autoscaling_config": "decoder_cpu.max_replicas bounds the fallback's policy "
        "(autoscaling.policy.CpuFallbackAutoscalingPolicy, up while the GPU decoder's floor may be 0); "
        "decoder_cpu.num_replicas keeps a fixed count up instead",
    }

    enabled: bool = Field(False, description="deploy DecoderCPU")
    num_cpus: float = inherited(ReplicaArgs, "num_cpus", 1.0)
    max_batch_size: int = Field(4, ge=1, description="sentences decoding at once in a fallback replica's loop")
    max_queued_requests: int | None = inherited(ReplicaArgs, "max_queued_requests", 32)
    num_replicas: int | None = Field(
        None,
        ge=1,
        description="a fixed count, always up; None: scaled by autoscaling.policy.CpuFallbackAutoscalingPolicy, up "
        "while the GPU decoder's schedule may take it to 0 (from 10 minutes before to 15 after)",
    )
    max_replicas: int = Field(4, ge=1, description="the most fallback replicas the policy runs")
    poll_interval_s: float = Field(2.0, gt=0, description="how often the ingress re-reads the replica counts")

    @property
    def scaling_rules(self) -> ScalingRules:
        """The fallback's own rules: the seed's thresholds, 1 to `max_replicas` while it is up, no schedule of its
        own (the GPU decoder's decides when it is up)."""
        return ScalingRules(min_replicas=1, max_replicas=self.max_replicas, schedule=Schedule())

    wake: bool = Field(
        True,
        description="inside the GPU decoder's 0-floor windows, waits at this fallback wake a GPU decoder replica "
        "(autoscaling.policy.WakeRule; needs decoder.autoscaling)",
    )
    wake_wait_s: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="wake when a fallback replica's oldest request without audio has waited this long (Serve's "
        "average over look_back_period_s): its first audio comes later still; None: scheduler.target_first_audio_s",
    )
    wake_queued: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="wake too when this many requests (Serve's mean over look_back_period_s) queue at the fallback's "
        "handles: every fallback replica holds max_ongoing_requests, and the queued ones' waits are not reported",
    )
    wake_hold_s: float = Field(
        900.0,
        ge=0,
        allow_inf_nan=False,
        description="the GPU decoder's floor stays 1 this long after the load last passed the rule; then the night "
        "floor again",
    )


class SecurityArgs(_Strict):
    api_keys: tuple[SecretStr, ...] = Field((), description="bearer tokens accepted on every endpoint but /healthz")
    api_keys_env: str | None = Field(
        "COSYVOICE_API_KEYS", description="env variable read by the ingress replicas: more keys, comma-separated"
    )
    admin_keys: tuple[SecretStr, ...] = Field(
        (),
        description="bearer tokens accepted like api_keys that also see, use and delete every registered voice "
        "(other keys: only their own and the shared ones)",
    )
    admin_keys_env: str | None = Field(
        "COSYVOICE_ADMIN_KEYS",
        description="env variable read by the ingress replicas: more admin keys, comma-separated",
    )
    allowed_model_roots: tuple[str, ...] | None = Field(
        None, description="directories a model dir must lie in (symlinks resolved); None: any path without '..'"
    )
    allowed_hosts: tuple[str, ...] | None = Field(
        None,
        description="Host header names (without port) the server answers, '*' for any; others get 421 (DNS "
        "rebinding). None: without API keys localhost, 127.0.0.1, [::1] and the HTTP host Serve binds; with keys any",
    )
    allowed_origins: tuple[str, ...] = Field(
        (),
        description="browser origins (scheme://host[:port]) besides the server's own that may POST or DELETE on a "
        "server without API keys, '*' for any; other cross-origin writes get 403 (cross-site request forgery)",
    )


# OpenAI's speech voices. The presets' built-in speakers are dummy_female and dummy_male: OpenAI's voices split
# between them by the register OpenAI describes (an official model dir names its own speakers in `openai.voices`).
OPENAI_VOICE_NAMES = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "onyx",
    "nova",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)
DEFAULT_OPENAI_VOICES = {
    "alloy": "dummy_female",
    "ash": "dummy_male",
    "ballad": "dummy_male",
    "coral": "dummy_female",
    "echo": "dummy_male",
    "fable": "dummy_male",
    "onyx": "dummy_male",
    "nova": "dummy_female",
    "sage": "dummy_female",
    "shimmer": "dummy_female",
    "verse": "dummy_male",
    "marin": "dummy_female",
    "cedar": "dummy_male",
}
DEFAULT_MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


class OpenAIArgs(_Strict):
    """What lets code written for OpenAI's speech endpoint run unchanged: its model and voice names, and instructions
    that a voice cannot follow."""

    model_aliases: tuple[str, ...] = Field(
        DEFAULT_MODEL_ALIASES, description="`model` values accepted besides the served model name (and listed)"
    )
    voices: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_OPENAI_VOICES),
        description="voice name -> a built-in speaker or registered voice id of the served model",
    )
    strict_instructions: bool = Field(
        False,
        description="answer 400 to `instructions` the voice cannot follow (/v1/audio/speech, the text stream's "
        "start); false: speak the input without them, as OpenAI's tts-1 does, and say so (X-Instructions: ignored)",
    )

    @model_validator(mode="after")
    def _names_are_not_empty(self) -> OpenAIArgs:
        if any(not alias.strip() for alias in self.model_aliases):
            raise ValueError("openai.model_aliases must not hold empty names")
        if any(not name.strip() or not target.strip() for name, target in self.voices.items()):
            raise ValueError("openai.voices must map non-empty names to non-empty voices")
        return self


class AudioArgs(_Strict):
    """The bit rates of the lossy formats, chosen for clean speech at 22-24 kHz mono: mp3 at the 160 kbit/s MPEG-2
    maximum at those rates, aac and opus where speech has no audible artefacts."""

    mp3_kbps: int = Field(160, ge=32, le=160, description="mp3 (MPEG-2 layer III at 22.05/24 kHz: 160 at most)")
    aac_kbps: int = Field(96, ge=16, le=256, description="aac (no audible artefacts on speech at 96)")
    opus_kbps: int = Field(64, ge=6, le=256, description="opus (no audible artefacts on speech at 64)")

    def bit_rate(self, format_name: str) -> int | None:
        """Bits per second of a lossy format; None for the lossless ones."""
        kbps = {"mp3": self.mp3_kbps, "aac": self.aac_kbps, "opus": self.opus_kbps}.get(format_name)
        return None if kbps is None else kbps * 1000


class ProvisionedVoiceArgs(_Strict):
    """A voice registered at start-up (idempotently: the same id on every start and every replica is one voice),
    shared by every API key, outside `limits.max_voices_per_key`; only an admin key deletes it (the next start
    registers it again)."""

    file: str = Field(
        min_length=1,
        description="the recording (1-30 s, wav/flac/ogg/mp3, 16-48 kHz): a path every encoder node can read (the "
        "model volume) or an object-store URL (s3://bucket/key)",
    )
    transcript: str = Field(min_length=1, description="what the recording says")
    id: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="the operator's name for it; its registry id is this when it has the shape voice_<12 hex>, else "
        "one derived from it (GET /v1/voices shows it)",
    )
    name: str | None = Field(None, min_length=1, max_length=64, description="its display name (default: id)")
    openai_name: str | None = Field(
        None, min_length=1, description="the OpenAI voice name (alloy, ash, ...) that stands for it in openai.voices"
    )

    @property
    def voice_id(self) -> str:
        return provisioned_voice_id(self.id)

    @model_validator(mode="after")
    def _readable_path(self) -> ProvisionedVoiceArgs:
        if not is_store_url(self.file) and ".." in Path(self.file).parts:
            raise ValueError(f"voice file path {self.file!r} must not contain '..'")
        if not self.transcript.strip():
            raise ValueError("a provisioned voice needs a transcript")
        return self


def check_model_source(model: str, allowed_roots: tuple[str, ...] | None) -> None:
    """A preset; a hub id (`engine.loading.model_source`) when no `allowed_roots` are given (they admit local
    directories only); or a path without '..' that resolves inside one of `allowed_roots` (when given)."""
    if model in PRESETS:
        return
    try:
        hub = hub_model(model)
    except CheckpointError as exc:  # a malformed modelscope: id
        raise ValueError(exc.message) from None
    if hub is not None:
        if allowed_roots is not None:
            raise ValueError(
                f"model {model!r} is a hub id, but security.allowed_model_roots admits only directories inside "
                f"{list(allowed_roots)}: download it there and give its directory"
            )
        return
    path = Path(model)
    if ".." in path.parts:
        raise ValueError(f"model path {model!r} must not contain '..'")
    if allowed_roots is None:
        return
    resolved = path.resolve()
    if not any(resolved.is_relative_to(Path(root).resolve()) for root in allowed_roots):
        raise ValueError(f"model path {model!r} is outside the allowed model roots {list(allowed_roots)}")


class AppArgs(_Strict):
    """Everything `build_app` needs; every field has a default that runs on a laptop CPU."""

    model: str = Field(
        "tiny",
        description="an official CosyVoice model dir, a Hugging Face id of one (FunAudioLLM/Fun-CosyVoice3-0.5B-2512, "
        "resolved into the Hugging Face cache by every replica), modelscope:<id> (the modelscope extra), or a preset "
        "(tiny, dummy, cosyvoice2-tiny, cosyvoice3-tiny...)",
    )
    llm_checkpoint: str = Field(
        LLM_CHECKPOINT_AUTO,
        pattern=r"^(auto|[\w.-]+\.pt)$",
        description="the LLM checkpoint of an official model dir: auto (the RL-tuned llm.rl.pt where the model has it, "
        "as Fun-CosyVoice3-0.5B-2512 does, else llm.pt) or a file name in the dir (llm.pt: the official code's)",
    )
    served_model_name: str | None = Field(
        None, description="name shown by /v1/models (default: from `model`: a hub id's repo name, a dir's name)"
    )
    cpu_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each CPU replica (ingress, encoders, the CPU fallback decoder) needs, e.g. "
        "{cpu_node: 1} to keep them on nodes that declare `cpu_node` (the cluster files give it to CPU nodes only)",
    )
    ingress: IngressArgs = IngressArgs()
    encoder: EncoderArgs = EncoderArgs()
    decoder: DecoderArgs = DecoderArgs()
    limits: LimitsArgs = LimitsArgs()
    text: TextArgs = TextArgs()
    decoder_cpu: CpuFallbackArgs = CpuFallbackArgs()
    scheduler: SchedulerArgs = SchedulerArgs()
    security: SecurityArgs = SecurityArgs()
    openai: OpenAIArgs = OpenAIArgs()
    audio: AudioArgs = AudioArgs()
    wyoming: WyomingArgs = WyomingArgs()
    voices_dir: str | None = Field(
        None,
        description="where registered (cloned) voices are kept, shared by the encoder replicas: a directory, or an "
        "object-store URL such as s3://bucket/prefix (the s3 extra; credentials and endpoint from the AWS_* "
        "environment of the replicas); None: cloning off",
    )
    voices: tuple[ProvisionedVoiceArgs, ...] = Field(
        (),
        description="voices registered at start-up (needs voices_dir), e.g. the voice behind OpenAI's alloy on a model "
        "without built-in speakers (CosyVoice3)",
    )
    default_voice: bool = Field(
        True,
        description="a model without built-in speakers (CosyVoice3) is provisioned the official zero-shot prompt "
        "voice at start-up (engine/voices/assets, needs voices_dir) and answers the OpenAI voice names that nothing "
        "else stands for (openai.voices to a registered id, a provisioned or registered voice's openai_name) in it",
    )
    voice_models_dir: str | None = Field(
        None,
        description="dir with campplus.onnx and speech_tokenizer_v1.onnx (v2, v3: _v2.onnx, _v3.onnx); default: the "
        "model dir, or for a tiny preset the tiny cloning models it ships",
    )

    @model_validator(mode="before")
    @classmethod
    def _prompt_cache_share_moved(cls, data: Any) -> Any:
        """`scheduler.prompt_cache_share` (its old place) is read as `decoder.prompt_cache_share`, with a warning."""
        if not isinstance(data, Mapping) or not isinstance(data.get("scheduler"), Mapping):
            return data
        scheduler = dict(data["scheduler"])
        if "prompt_cache_share" not in scheduler:
            return data
        share = scheduler.pop("prompt_cache_share")
        decoder = data.get("decoder") or {}
        if isinstance(decoder, BaseModel):
            decoder = decoder.model_dump(exclude_unset=True)
        if "prompt_cache_share" in decoder:
            raise ValueError("prompt_cache_share is set twice: keep decoder.prompt_cache_share (its new place) only")
        logger.warning("scheduler.prompt_cache_share is deprecated: it is read as decoder.prompt_cache_share")
        return {**data, "scheduler": scheduler, "decoder": {**decoder, "prompt_cache_share": share}}

    @model_validator(mode="before")
    @classmethod
    def _cpu_resources_moved(cls, data: Any) -> Any:
        """`resources` of ingress, encoder and decoder_cpu (their old place) are read as `cpu_resources`, with a
        warning, where every deployed CPU section gives the same."""
        if not isinstance(data, Mapping):
            return data
        sections = {name: data.get(name) for name in CPU_REPLICA_SECTIONS}
        given = {
            name: section["resources"]
            for name, section in sections.items()
            if isinstance(section, Mapping) and "resources" in section
        }
        if not given:
            return data
        fallback = sections["decoder_cpu"]
        fallback_on = (
            fallback.get("enabled", False) if isinstance(fallback, Mapping) else bool(fallback and fallback.enabled)
        )
        deployed = {"ingress", "encoder"} | ({"decoder_cpu"} if fallback_on else set())
        first = next(iter(given.values()))
        if "cpu_resources" in data or not deployed <= given.keys() or any(value != first for value in given.values()):
            raise ValueError(
                f"{', '.join(f'{name}.resources' for name in given)}: {CPU_RESOURCES_MOVED}; set it once instead"
            )
        logger.warning("%s.resources are deprecated: they are read as cpu_resources", "/".join(given))
        moved = {name: {k: v for k, v in sections[name].items() if k != "resources"} for name in given}
        return {**data, **moved, "cpu_resources": first}

    def wake_rule(self) -> WakeRule | None:
        """When the CPU fallback's load wakes the GPU decoder (None: fallback, wake or decoder autoscaling off)."""
        fallback = self.decoder_cpu
        if not (fallback.enabled and fallback.wake and self.decoder.autoscaling is not None):
            return None
        wait_s = self.scheduler.target_first_audio_s if fallback.wake_wait_s is None else fallback.wake_wait_s
        return WakeRule(wait_s=wait_s, hold_s=fallback.wake_hold_s, queued=fallback.wake_queued)

    @model_validator(mode="after")
    def _wyoming_keyless_only_when_allowed(self) -> AppArgs:
        # The keys written here; those of the replicas' environment are checked where they are read.
        refusal = self.wyoming.keyless_refusal(bool(self.security.api_keys or self.security.admin_keys))
        if refusal is not None:
            raise ValueError(refusal)
        return self

    @model_validator(mode="after")
    def _model_inside_allowed_roots(self) -> AppArgs:
        check_model_source(self.model, self.security.allowed_model_roots)
        return self

    @model_validator(mode="after")
    def _text_streams_leave_slots_to_requests(self) -> AppArgs:
        limits, ingress_slots = self.limits, self.ingress.max_ongoing_requests
        if ingress_slots < 2:
            raise ValueError("ingress.max_ongoing_requests must be at least 2: text streams may hold only some")
        if limits.max_text_streams is not None and limits.max_text_streams >= ingress_slots:
            raise ValueError(
                f"limits.max_text_streams ({limits.max_text_streams}) must be below ingress.max_ongoing_requests "
                f"({ingress_slots}): text streams would take every slot plain requests need"
            )
        per_key, per_key_requests = limits.max_text_streams_per_key, limits.max_concurrent_requests_per_key
        if per_key is not None and per_key_requests is not None and per_key >= per_key_requests:
            raise ValueError(
                f"limits.max_text_streams_per_key ({per_key}) must be below limits.max_concurrent_requests_per_key "
                f"({per_key_requests}), which counts a key's text streams too"
            )
        return self

    @property
    def ingress_limits(self) -> LimitsArgs:
        """`limits` with the text stream caps left to their defaults worked out: half of the ingress replica's slots,
        and half of a key's requests in flight (at least 1)."""
        limits = self.limits
        per_key_requests = limits.max_concurrent_requests_per_key
        default_per_key = None if per_key_requests is None else max(1, per_key_requests // 2)
        return limits.model_copy(
            update={
                "max_text_streams": limits.max_text_streams or self.ingress.max_ongoing_requests // 2,
                "max_text_streams_per_key": limits.max_text_streams_per_key or default_per_key,
            }
        )

    @model_validator(mode="after")
    def _voice_models_located(self) -> AppArgs:
        if self.voices_dir is not None and self.voice_models_source is None:
            shipped = ", ".join(PRESET_VOICE_MODELS)
            raise ValueError(
                f"voice cloning (voices_dir) with the preset model {self.model!r} needs voice_models_dir: "
                f"only the presets {shipped} ship campplus / speech tokenizer ONNX files"
            )
        if self.voice_models_dir is not None:
            check_model_source(self.voice_models_dir, self.security.allowed_model_roots)
        return self

    @model_validator(mode="after")
    def _provisioned_voices(self) -> AppArgs:
        if self.voices and self.voices_dir is None:
            raise ValueError("voices (provisioned at start-up) need voices_dir: where registered voices are kept")
        ids = [voice.voice_id for voice in self.voices]
        if len(set(ids)) != len(ids):
            raise ValueError("voices: two provisioned voices have the same id")
        names = [voice.openai_name for voice in self.voices if voice.openai_name is not None]
        if len(set(names)) != len(names):
            raise ValueError("voices: two provisioned voices have the same openai_name")
        return self

    @property
    def openai_voices(self) -> dict[str, str]:
        """`openai.voices` with each provisioned voice's `openai_name` standing for it (over the table's entry)."""
        provisioned = {voice.openai_name: voice.voice_id for voice in self.voices if voice.openai_name is not None}
        return self.openai.voices | provisioned

    @property
    def voice_models_source(self) -> str | None:
        """Where the cloning models are: `voice_models_dir`, a preset's shipped ones, or the model (its dir, or the hub
        id whose resolved dir holds them); None: a preset that ships none."""
        if self.voice_models_dir is not None:
            return self.voice_models_dir
        if self.model in PRESETS:
            shipped = PRESET_VOICE_MODELS.get(self.model)
            return None if shipped is None else str(shipped)
        return self.model
