"""The decoder replicas' sections of the app args (`serve_app.args`): the GPU decoders, their autoscaling and
loop order, and the CPU fallback."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from autoscaling.policy import ScalingRules, WakeRule, decoder_autoscaling_config
from autoscaling.schedule import Schedule
from deployments.loop_bridge import MAX_CONCURRENT_BATCHES
from engine.nn.precision import AUTO_INT4_DTYPE
from engine.runtime.playback import DeadlinePolicy, FcfsPolicy, SchedulingPolicy
from serve_app.args_base import StrictArgs
from serve_app.deployment_options import moved_to_deployment
from serve_app.routing import CPU_DECODER, GPU_DECODER

# How the decoder replicas (the GPU's and the CPU fallback's) report to their policies: Serve's own defaults, the
# values the app args defaulted to before they left them.
DECODER_LOOK_BACK_PERIOD_S = 30.0
DECODER_METRICS_INTERVAL_S = 10.0


class DecoderAutoscalingArgs(StrictArgs):
    """The decoder policy (`autoscaling.policy.DecoderAutoscalingPolicy`)."""

    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {
        "look_back_period_s": f"fixed at Serve's default, {DECODER_LOOK_BACK_PERIOD_S:g} s "
        "(serve_app.decoder_args.DECODER_LOOK_BACK_PERIOD_S)",
        "metrics_interval_s": f"fixed at Serve's default, {DECODER_METRICS_INTERVAL_S:g} s "
        "(serve_app.decoder_args.DECODER_METRICS_INTERVAL_S)",
    }

    rules: ScalingRules = Field(
        default_factory=ScalingRules,
        description="thresholds, windows, min/max_replicas, schedule (autoscaling.policy.ScalingRules)",
    )

    def serve_config(self, wake: WakeRule | None = None) -> dict[str, Any]:
        """The GPU decoder deployment's Serve `autoscaling_config` (woken under `wake`, see `AppArgs.wake_rule`)."""
        return decoder_autoscaling_config(self.rules, DECODER_LOOK_BACK_PERIOD_S, DECODER_METRICS_INTERVAL_S, wake)


class DecoderArgs(StrictArgs):
    """Speech-token LM + flow + vocoder replicas; a GPU fraction each, or CPU with num_gpus 0 (their request bounds
    and fixed replica count: deployment `Decoder`)."""

    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {
        "max_ongoing_requests": moved_to_deployment("max_ongoing_requests", GPU_DECODER)
        + f"; its default stays 2 x max_batch_size x {MAX_CONCURRENT_BATCHES} admission batches",
        "max_queued_requests": moved_to_deployment("max_queued_requests", GPU_DECODER),
        "num_replicas": moved_to_deployment("num_replicas", GPU_DECODER) + " (without decoder.autoscaling)",
        "resources": "the GPU Decoder's ray_actor_options are built from decoder.num_cpus and decoder.num_gpus; "
        + moved_to_deployment("ray_actor_options: {resources: {...}}", "TTSIngress, Encoder or DecoderCPU"),
        "max_concurrent_batches": f"fixed at {MAX_CONCURRENT_BATCHES} "
        "(deployments.loop_bridge.MAX_CONCURRENT_BATCHES): one forming never waits for another, and the loop takes "
        "each in at its next step",
        "max_vocode_batch": "fixed at 8 on a GPU, 1 on CPU (engine.runtime.scheduler.DEFAULT_VOCODE_BATCH_CUDA, "
        "_CPU): on CPU the flow and vocoder run only ~1.2x faster at batch 8, and a small job lets a first chunk "
        "wait less (docs/performance.md)",
    }

    num_cpus: float = Field(0.5, gt=0, description="CPUs Ray reserves for each replica")
    autoscaling: DecoderAutoscalingArgs | None = Field(
        None, description="None: a fixed count (deployment Decoder's num_replicas, 1 by default)"
    )
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

    @property
    def ongoing_requests_limit(self) -> int:
        """Deployment Decoder's default max_ongoing_requests: room for two of every admission batch, so that
        batches can fill."""
        return 2 * self.batches_fill_at

    @property
    def batches_fill_at(self) -> int:
        """The fewest requests a replica must take at once for its admission batches to fill."""
        return self.max_batch_size * MAX_CONCURRENT_BATCHES


class SchedulerArgs(StrictArgs):
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

    # Tuned by measurement, not a deployment's choice (docs/performance.md, the late-short-stream runs on 2 CPU cores):
    # the loop keeps engine.runtime.playback.DeadlinePolicy's 1 s for each.
    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {
        "first_audio_hold_s": "fixed at the measured best, 1 s (a late short stream's median time to first audio "
        "0.40 s, against 0.56 s without a hold and 0.50 s with 2 s: docs/history/performance-runs.md)",
        "min_preempt_slack_s": "fixed at 1 s, lowered from 2 s by measurement (docs/history/performance-runs.md)",
        "first_audio_passover_s": "fixed at 1 s: 0.5 s made no difference beyond noise "
        "(docs/history/performance-runs.md, runs 30-31)",
        "whole_deadline_factor": "fixed at 2 (engine.runtime.playback.WHOLE_DEADLINE_FACTOR): a whole request's "
        "deadline is its arrival + 2 x its estimated audio, behind streams due sooner without starving it",
    }

    def decoder_policy(self) -> SchedulingPolicy:
        """The policy every decoder replica's loop orders its work by."""
        if self.policy == "fcfs":
            return FcfsPolicy()
        return DeadlinePolicy(target_first_audio_s=self.target_first_audio_s)


class CpuFallbackArgs(StrictArgs):
    """The optional `DecoderCPU` deployment: the Decoder on CPU (fp32), scaled by
    autoscaling.policy.CpuFallbackAutoscalingPolicy, up while the GPU decoder's schedule may take it to 0 (from 10
    minutes before to 15 after). Its CPUs and request bounds: deployment `DecoderCPU`."""

    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {
        "batch_wait_timeout_s": "the fallback waits decoder.batch_wait_timeout_s, as the GPU decoder does",
        "resources": moved_to_deployment("ray_actor_options: {num_cpus: ..., resources: {...}}", CPU_DECODER),
        "wake_wait_s": "derived: scheduler.target_first_audio_s, the first-audio SLO (a request that has waited "
        "that long without audio has missed it)",
        "wake_hold_s": "fixed at 900 s (autoscaling.policy.WAKE_HOLD_S): ten times the GPU replica's 90 s start; "
        "300 s or 1800 s simulate the same (docs/autoscaling.md)",
        "poll_interval_s": "fixed at 2 s (serve_app.routing.ROUTING_POLL_S): a read of the replica counts holds the "
        "ingress's GIL for ~28 ms, and replicas start and drain in tens of seconds",
        "autoscaling_config": "decoder_cpu.max_replicas bounds the fallback's policy "
        "(autoscaling.policy.CpuFallbackAutoscalingPolicy, up while the GPU decoder's floor may be 0)",
        "num_cpus": moved_to_deployment("ray_actor_options: {num_cpus: ...}", CPU_DECODER),
        "max_ongoing_requests": moved_to_deployment("max_ongoing_requests", CPU_DECODER),
        "max_queued_requests": moved_to_deployment("max_queued_requests", CPU_DECODER),
        "num_replicas": moved_to_deployment("num_replicas", CPU_DECODER)
        + " with `autoscaling_config: null` (a fixed count, always up)",
    }

    enabled: bool = Field(False, description="deploy DecoderCPU")
    max_batch_size: int = Field(4, ge=1, description="sentences decoding at once in a fallback replica's loop")
    max_replicas: int = Field(4, ge=1, description="the most fallback replicas the policy runs")

    @property
    def scaling_rules(self) -> ScalingRules:
        """The fallback's own rules: the seed's thresholds, 1 to `max_replicas` while it is up, no schedule of its
        own (the GPU decoder's decides when it is up)."""
        return ScalingRules(min_replicas=1, max_replicas=self.max_replicas, schedule=Schedule())

    wake: bool = Field(
        True,
        description="inside the GPU decoder's 0-floor windows, waits at this fallback wake a GPU decoder replica "
        "(autoscaling.policy.WakeRule; needs decoder.autoscaling): a first audio waited for past "
        "scheduler.target_first_audio_s, or `wake_queued` requests queued at the fallback's handles; the GPU floor "
        "then stays 1 until 900 s after the load last passed the rule",
    )
    wake_queued: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="wake too when this many requests (Serve's mean over look_back_period_s) queue at the fallback's "
        "handles: every fallback replica holds max_ongoing_requests, and the queued ones' waits are not reported",
    )
