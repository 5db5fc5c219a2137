"""Typed arguments of the application builder (`serve_app:build_app`), as given in a Serve config's `args`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EncoderArgs(_Strict):
    """CPU replicas: frontend, text encoder, voice features."""

    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.5, gt=0)
    int8: bool = Field(False, description="INT8 dynamic quantization of the text encoder's Linear layers")
    max_ongoing_requests: int = Field(8, ge=1)


class DecoderArgs(_Strict):
    """Speech-token LM + flow + vocoder replicas; a GPU fraction each, or CPU with num_gpus 0."""

    num_replicas: int = Field(1, ge=1)
    num_gpus: float = Field(0.0, ge=0, le=1, description="GPU fraction per replica; 0 runs on CPU")
    num_cpus: float = Field(0.5, gt=0)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto: float16 when the replica has a GPU, else float32"
    )
    max_batch_size: int = Field(4, ge=1)
    batch_wait_timeout_s: float = Field(0.05, ge=0)
    max_concurrent_batches: int = Field(1, ge=1)
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="default: 2 x max_batch_size x max_concurrent_batches (batches must be able to fill)"
    )
    memory_budget_gb: float | None = Field(
        None, gt=0, description="device memory a replica may use for activations; caps the batch size"
    )

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


class LimitsArgs(_Strict):
    max_input_chars: int = Field(4096, ge=1, description="longer inputs are rejected with 400")
    long_text_chars: int = Field(300, ge=1, description="inputs longer than this take the streaming path")
    health_timeout_s: float = Field(2.0, gt=0, description="how long /healthz waits for each stage")


class IngressArgs(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.25, gt=0)
    max_ongoing_requests: int = Field(64, ge=1)


class AppArgs(_Strict):
    """Everything `build_app` needs; every field has a default that runs on a laptop CPU."""

    model: str = Field("tiny", description="an official CosyVoice v1 model dir, or a preset: tiny, dummy")
    served_model_name: str | None = Field(None, description="name shown by /v1/models (default: from `model`)")
    ingress: IngressArgs = IngressArgs()
    encoder: EncoderArgs = EncoderArgs()
    decoder: DecoderArgs = DecoderArgs()
    limits: LimitsArgs = LimitsArgs()
