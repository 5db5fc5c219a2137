"""The ingress deployment `TTSIngress` and the application builder `build_app(args)`.

`TTSIngress` is one Serve replica made by composition: it holds one `Synthesis` (the way to the encoder and the
decoders, `serve_app.synthesis`) and the route groups on it: health and models (`health_routes`), voices
(`voice_routes`), OpenAI's speech endpoint (`openai_routes`) with its text stream WebSocket (`speech_stream_routes`),
and the native endpoint (`native_routes`); Serve asks it for its FastAPI app (`serve_app.api.build_api`, with the
middlewares' settings of this replica) once it is made. Its own methods are what the Wyoming listener calls
(`wyoming_speech`).
"""

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from autoscaling.policy import RayWakeBoard, ScalingRules, WakeRule, cpu_fallback_autoscaling_config
from deployments.decoder import Decoder
from deployments.encoder import Encoder, ProvisionedVoice, VoiceCloningConfig
from deployments.loop_bridge import MAX_CONCURRENT_BATCHES
from deployments.text_relay import TextRelays
from engine.loading.model_source import hub_model, served_name
from engine.voices.cloning import MAX_PROMPT_AUDIO_BYTES
from engine.voices.registry import Caller
from engine.voices.store import is_store_url
from observability import STRUCTURED_LOGGING
from serve_app.api import RouteGroup, build_api
from serve_app.args import AppArgs
from serve_app.browser_rules import browser_rules
from serve_app.decoder_args import DECODER_LOOK_BACK_PERIOD_S, DECODER_METRICS_INTERVAL_S
from serve_app.deployment_options import (
    DEFAULT_OPTIONS,
    DEPLOYMENT_NAMES,
    ENCODER,
    INGRESS,
    WYOMING,
    effective_options,
    parse_overrides,
)
from serve_app.errors import RETRY_AFTER_S
from serve_app.guard import GuardSettings, load_admin_keys, load_api_keys, serving_warnings
from serve_app.health_routes import HealthRoutes
from serve_app.native_routes import NativeRoutes
from serve_app.openai_routes import OpenAIRoutes
from serve_app.request_args import LimitsArgs, OpenAIArgs, SecurityArgs
from serve_app.routing import CPU_DECODER, GPU_DECODER, ROUTING_POLL_S, DecoderRouter
from serve_app.speech_stream_routes import SpeechStreamRoutes
from serve_app.synthesis import Synthesis
from serve_app.tenancy import TenancySettings
from serve_app.voice_routes import VOICES_PATH, VoiceRoutes
from serve_app.wyoming_speech import WyomingCatalog, WyomingSpeech

logger = logging.getLogger("ray.serve")

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


def request_checks(
    security: SecurityArgs, limits: LimitsArgs, bound_host: str | None
) -> tuple[GuardSettings, TenancySettings, tuple[str, ...]]:
    """The middlewares' settings of an ingress replica whose HTTP proxies bind `bound_host` (its API keys read from
    `security` and this process's environment), and the warnings of how it serves."""
    keys = load_api_keys(security)
    admin_keys = load_admin_keys(security)
    keys_on = bool(keys + admin_keys)
    upload_limit = max(limits.max_body_bytes, MAX_PROMPT_AUDIO_BYTES + UPLOAD_FORM_OVERHEAD_BYTES)
    guard = GuardSettings(
        keys + admin_keys,
        limits.max_body_bytes,
        {VOICES_PATH: upload_limit},
        browser=browser_rules(security, bound_host, keys_on),
    )
    tenancy = TenancySettings(
        keys_on=keys_on,
        admin_keys=admin_keys,
        max_concurrent_requests_per_key=limits.max_concurrent_requests_per_key,
    )
    return guard, tenancy, serving_warnings(security, bound_host, keys_on)


@serve.ingress()
class IngressReplica:
    """The HTTP ingress: one `Synthesis`, the route groups on it and their app, and the Wyoming listener's calls."""

    def __init__(
        self,
        encoder: DeploymentHandle,
        decoder: DeploymentHandle,
        model_name: str,
        limits: LimitsArgs,
        security: SecurityArgs | None = None,
        openai: OpenAIArgs | None = None,
        decoder_cpu: DeploymentHandle | None = None,
        gpu_rules: ScalingRules | None = None,
        wake: WakeRule | None = None,
        wyoming: DeploymentHandle | None = None,
    ) -> None:
        self.guard, self.tenancy, warnings = request_checks(security or SecurityArgs(), limits, serve_http_host())
        for warning in warnings:
            logger.warning(warning)
        decoders = {GPU_DECODER: decoder} | ({} if decoder_cpu is None else {CPU_DECODER: decoder_cpu})
        router = DecoderRouter(decoders, ROUTING_POLL_S, gpu_rules, RayWakeBoard() if wake else None)
        router.start(serve.get_replica_context().app_name)
        synthesis = Synthesis(encoder, router, model_name, limits, openai or OpenAIArgs())
        text_relays = TextRelays()  # the text streams' relay to the decoders (CosyVoice2/3)
        openai_routes = OpenAIRoutes(synthesis)
        self.route_groups: tuple[RouteGroup, ...] = (
            HealthRoutes(synthesis, warnings, text_relays, wyoming),
            VoiceRoutes(synthesis),
            openai_routes,
            SpeechStreamRoutes(synthesis, openai_routes, text_relays),
            NativeRoutes(synthesis),
        )
        self.wyoming_calls = WyomingSpeech(synthesis)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The replica's app, which Serve asks for once the replica is made."""
        return build_api(self.route_groups, self.guard, self.tenancy)

    async def wyoming_catalog(self, caller: Caller) -> WyomingCatalog:
        """Wyoming's `describe` for `caller` (`WyomingSpeech.catalog`)."""
        return await self.wyoming_calls.catalog(caller)

    async def wyoming_speech(
        self, text: str, voice: str | None, caller: Caller, request_id: str
    ) -> AsyncIterator[tuple[int, bytes]]:
        """Wyoming's `synthesize`: `text` as PCM chunks (`WyomingSpeech.speech`), streamed through the handle."""
        async for chunk in self.wyoming_calls.speech(text, voice, caller, request_id):
            yield chunk


# A module attribute of its own (the deployment is not a class): a replica unpickling the deployment imports this
# module, and so the classes its replica is made of. The serve_app package builds nothing on import (the CLI must
# start at once).
TTSIngress = serve.deployment(name=INGRESS, logging_config=STRUCTURED_LOGGING)(IngressReplica)


def voice_cloning_config(args: AppArgs) -> VoiceCloningConfig | None:
    """The encoders' cloning setup; None (registering answers 501) without `voices_dir`."""
    models_source = args.voice_models_source
    if args.voices_dir is None or models_source is None:  # AppArgs refuses voices_dir without models
        return None
    # Absolute paths: the replicas need not share the caller's working directory (a URL stays as it is).
    voices_dir = args.voices_dir if is_store_url(args.voices_dir) else str(Path(args.voices_dir).resolve())
    return VoiceCloningConfig(
        voices_dir=voices_dir,
        models_dir=models_source if hub_model(models_source) else str(Path(models_source).resolve()),
        max_voices=args.limits.max_voices,
        max_voices_per_key=args.limits.max_voices_per_key,
        voices=tuple(
            ProvisionedVoice(
                file=voice.file if is_store_url(voice.file) else str(Path(voice.file).resolve()),
                transcript=voice.transcript.strip(),
                voice_id=voice.voice_id,
                name=voice.name or voice.id,
            )
            for voice in args.voices
        ),
        default_voice=args.default_voice,
    )


# Beyond the longest stream: a replica being removed (scale-down, redeploy) first finishes what it serves.
SHUTDOWN_MARGIN_S = 30.0
# How often a replica being removed checks whether its last request is done: Serve's default (2 s) is waited out
# before the first check, so every replica's stop (scale-downs and redeploys too) took 2 s more than its work.
SHUTDOWN_POLL_S = 0.25


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    """The Serve application: ingress -> Encoder (CPU) -> Decoder (GPU fraction or CPU). Serve's builder: it takes
    the args only (a Serve config's `deployments:` section is applied by Serve itself)."""
    return build_app_with_overrides(args)


def deployed_names(args: AppArgs) -> tuple[str, ...]:
    """The deployments `args` build."""
    optional = {CPU_DECODER: args.decoder_cpu.enabled, WYOMING: args.wyoming.port is not None}
    return tuple(name for name in DEPLOYMENT_NAMES if optional.get(name, True))


def _decoder_checks(args: AppArgs, decoder: dict[str, Any], code: dict[str, Any]) -> None:
    """The GPU Decoder's effective options against the decoder args they must agree with."""
    if decoder["ray_actor_options"] != code["ray_actor_options"]:
        raise ValueError(
            f"deployments: {GPU_DECODER}'s ray_actor_options are built from decoder.num_cpus and decoder.num_gpus "
            "(the plan, the memory budget and the MPS share read them): set those instead"
        )
    needed = args.decoder.batches_fill_at
    if decoder["max_ongoing_requests"] < needed:
        raise ValueError(
            f"deployments: {GPU_DECODER}'s max_ongoing_requests ({decoder['max_ongoing_requests']}) must be >= "
            f"decoder.max_batch_size x {MAX_CONCURRENT_BATCHES} admission batches at once ({needed}), or batches never "
            "fill"
        )


def _text_stream_checks(args: AppArgs, ingress: dict[str, Any]) -> None:
    ingress_slots = ingress["max_ongoing_requests"]
    if ingress_slots < 2:
        raise ValueError(f"deployments: {INGRESS}'s max_ongoing_requests must be at least 2: text streams hold some")
    if args.limits.max_text_streams >= ingress_slots:
        raise ValueError(
            f"limits.max_text_streams ({args.limits.max_text_streams}) must be below {INGRESS}'s max_ongoing_requests "
            f"({ingress_slots}): text streams would take every slot plain requests need"
        )


def build_app_with_overrides(
    args: AppArgs | dict[str, Any], deployments: Sequence[Mapping[str, Any]] | None = None
) -> Application:
    """`build_app` with a Serve config's `deployments:` section applied as Serve applies it (`cosyvoice-serve run`,
    `serve_app.full_config`): unknown deployments or options, and an override of the GPU Decoder's
    ray_actor_options, are a ValueError."""
    args = AppArgs.model_validate(args)
    overrides = parse_overrides(deployments, deployed_names(args))
    # Bounded queues: a request over a bound is answered 503 with Retry-After instead of waiting without end.
    backpressure = {"retry_after_s": RETRY_AFTER_S}
    stopping = {
        "graceful_shutdown_timeout_s": args.limits.max_stream_s + SHUTDOWN_MARGIN_S,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
    }

    def options(name: str, code: Mapping[str, Any]) -> dict[str, Any]:
        return effective_options({**DEFAULT_OPTIONS[name], **code}, overrides.get(name, {}))

    encoder = Encoder.options(
        # its requests are short: Serve's default timeout (20 s)
        **options(ENCODER, {"backpressure_config": backpressure, "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S})
    ).bind(
        args.model,
        args.encoder.int8,
        args.limits.max_input_chars,
        voice_cloning_config(args),
        llm_checkpoint=args.llm_checkpoint,
        max_text_tokens=args.limits.max_input_tokens,
        spell_out_languages=args.text.spell_out_languages,
    )
    decoder_loop = {
        "max_audio_s": args.limits.max_audio_s,
        "max_request_s": args.limits.max_stream_s,
        "policy": args.scheduler.decoder_policy(),
        "prompt_cache_share": args.decoder.prompt_cache_share,
        "llm_checkpoint": args.llm_checkpoint,
    }
    decoder_scaling = args.decoder.autoscaling
    gpu_rules = decoder_scaling.rules if decoder_scaling else None
    wake = args.wake_rule()
    decoder_code = {
        "max_ongoing_requests": args.decoder.ongoing_requests_limit,
        "backpressure_config": backpressure,
        **stopping,
        "ray_actor_options": {"num_cpus": args.decoder.num_cpus, "num_gpus": args.decoder.num_gpus}
        # set before the replica's process starts, so before CUDA reads it (at the first CUDA call)
        | ({"runtime_env": {"env_vars": args.decoder.mps_env}} if args.decoder.mps_env else {}),
    } | ({"autoscaling_config": decoder_scaling.serve_config(wake)} if decoder_scaling else {})
    decoder_options = options(GPU_DECODER, decoder_code)
    _decoder_checks(args, decoder_options, decoder_code)
    decoder = Decoder.options(**decoder_options).bind(
        args.model,
        use_gpu=args.decoder.num_gpus > 0,
        dtype=args.decoder.dtype,
        max_batch_size=args.decoder.max_batch_size,
        batch_wait_timeout_s=args.decoder.batch_wait_timeout_s,
        memory_budget_gb=args.decoder.memory_budget_gb,
        gpu_fraction=args.decoder.num_gpus,
        **decoder_loop,
    )
    fallback = args.decoder_cpu
    decoder_cpu = None
    if fallback.enabled:
        # The same Decoder class on CPU, each stage's precision chosen for the CPU (`auto`: bfloat16 flow where the
        # CPU has native bfloat16, INT8 LLM; float32 for the tiny models), scaled by its own policy (up while the GPU
        # decoders may be at 0), whose replicas report as often as the GPU decoder's: their waits wake a GPU replica.
        scaling = cpu_fallback_autoscaling_config(
            gpu_rules,
            fallback.scaling_rules,
            look_back_period_s=DECODER_LOOK_BACK_PERIOD_S,
            metrics_interval_s=DECODER_METRICS_INTERVAL_S,
            wake=wake,
        )
        fallback_code = {"backpressure_config": backpressure, **stopping, "autoscaling_config": scaling}
        decoder_cpu = Decoder.options(name=CPU_DECODER, **options(CPU_DECODER, fallback_code)).bind(
            args.model,
            use_gpu=False,
            dtype="auto",
            max_batch_size=fallback.max_batch_size,
            batch_wait_timeout_s=args.decoder.batch_wait_timeout_s,
            **decoder_loop,
        )
    wyoming = None
    if args.wyoming.port is not None:
        # Imported only when asked for: it needs the optional `wyoming` package.
        from serve_app.wyoming_server import WyomingServer

        wyoming = WyomingServer.options(**options(WYOMING, {})).bind(
            args.wyoming, args.limits, args.security, TTSIngress.name
        )
    ingress_options = options(INGRESS, {"backpressure_config": backpressure, **stopping})
    _text_stream_checks(args, ingress_options)
    return TTSIngress.options(**ingress_options).bind(
        encoder,
        decoder,
        args.served_model_name or served_name(args.model),
        args.limits,
        security=args.security,
        openai=args.openai.model_copy(update={"voices": args.openai_voices}),
        decoder_cpu=decoder_cpu,
        gpu_rules=gpu_rules,
        wake=wake,
        wyoming=wyoming,
    )


# The default application (tiny model, CPU), for `serve run serve_app:app` and `serve build serve_app:app`.
app = build_app(AppArgs())
