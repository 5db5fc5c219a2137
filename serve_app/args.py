"""Typed arguments of the application builder (`serve_app:build_app`), as given in a Serve config's `args`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, Field, model_validator

from autoscaling.policy import WakeRule
from engine.errors import CheckpointError
from engine.loading.loader import PRESET_VOICE_MODELS, PRESETS
from engine.loading.model_source import LLM_CHECKPOINT_AUTO, hub_model
from serve_app.args_base import StrictArgs
from serve_app.decoder_args import CpuFallbackArgs, DecoderArgs, SchedulerArgs
from serve_app.deployment_options import CPU_DECODER, ENCODER, INGRESS, moved_to_deployment
from serve_app.replica_args import EncoderArgs, TextArgs, WyomingArgs
from serve_app.request_args import LimitsArgs, OpenAIArgs, ProvisionedVoiceArgs, SecurityArgs

logger = logging.getLogger("ray.serve")


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


class AppArgs(StrictArgs):
    """Everything `build_app` needs; every field has a default that runs on a laptop CPU. Serve's own options of the
    deployments (replicas, CPUs, request bounds, custom resources) are the Serve config's `deployments:`
    (`serve_app.deployment_options`)."""

    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {
        "ingress": "its num_replicas, max_ongoing_requests, max_queued_requests and num_cpus: "
        + moved_to_deployment("num_replicas, max_ongoing_requests, max_queued_requests, ray_actor_options", INGRESS),
        "cpu_resources": moved_to_deployment(
            "ray_actor_options: {num_cpus: ..., resources: {cpu_node: 1}}", f"{INGRESS}, {ENCODER} and {CPU_DECODER}"
        ),
        "audio": "the whole section: the lossy formats' bit rates are fixed at mp3 160, aac 96 and opus 64 kbit/s "
        "(serve_app.audio.LOSSY_BIT_RATES: clean speech at 22-24 kHz, mp3 at MPEG-2's maximum there)",
    }

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
    encoder: EncoderArgs = EncoderArgs()
    decoder: DecoderArgs = DecoderArgs()
    limits: LimitsArgs = LimitsArgs()
    text: TextArgs = TextArgs()
    decoder_cpu: CpuFallbackArgs = CpuFallbackArgs()
    scheduler: SchedulerArgs = SchedulerArgs()
    security: SecurityArgs = SecurityArgs()
    openai: OpenAIArgs = OpenAIArgs()
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

    def wake_rule(self) -> WakeRule | None:
        """When the CPU fallback's load wakes the GPU decoder (None: fallback, wake or decoder autoscaling off)."""
        fallback = self.decoder_cpu
        if not (fallback.enabled and fallback.wake and self.decoder.autoscaling is not None):
            return None
        # a request at the fallback that has waited the first-audio SLO without audio has missed it
        return WakeRule(wait_s=self.scheduler.target_first_audio_s, queued=fallback.wake_queued)

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
