"""The `Encoder` deployment: frontend, text encoder and voice features, on CPU only (optionally INT8)."""

from __future__ import annotations

import logging
from typing import Any

from ray import serve

from engine.loader import load_model
from engine.pipeline import EncodedSegment, SynthesisRequest, TextEncoderStage
from observability import STRUCTURED_LOGGING

logger = logging.getLogger("ray.serve")


@serve.deployment(name="Encoder", ray_actor_options={"num_gpus": 0}, logging_config=STRUCTURED_LOGGING)
class Encoder:
    def __init__(self, model: str, int8: bool, max_text_chars: int) -> None:
        loaded = load_model(model, components=("encoder",), int8=int8, max_text_chars=max_text_chars)
        self.model_name = loaded.name
        self.stage = TextEncoderStage(loaded)

    def encode(self, request: SynthesisRequest, request_id: str = "") -> list[EncodedSegment]:
        """One encoded segment per sentence, in order (engine errors propagate to the caller)."""
        segments = self.stage.encode(request)
        logger.info("encoded %d segment(s)", len(segments), extra={"request_id": request_id})
        return segments

    def info(self) -> dict[str, Any]:
        return {"model": self.model_name, "voices": self.stage.voices, "sample_rate": self.stage.sample_rate}

    def ping(self) -> bool:
        return True
