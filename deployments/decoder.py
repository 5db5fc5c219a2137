"""The `Decoder` deployment: batched speech-token LM + flow + vocoder on a GPU fraction (FP16), or on CPU (fp32).

Whole-utterance requests (`synthesize`) go through one `@serve.batch` queue, streaming ones (`stream`)
through a streaming `@serve.batch` queue; both share the batch size, which a memory budget may cap.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ray import serve

from autoscaling.metrics import GpuProbe, ReplicaLoadTracker, gpu_utilization_sampler
from engine.errors import CosyVoiceError
from engine.loader import load_model
from engine.pipeline import EncodedSegment, SpeechDecoderStage
from observability import STRUCTURED_LOGGING
from observability.metrics import DecoderMetrics

logger = logging.getLogger("ray.serve")

# Placeholders only: __init__ sets the configured values through the batch methods' setters.
_INITIAL_BATCH_SIZE, _INITIAL_WAIT_S = 4, 0.05


@dataclass(eq=False)
class _Slot:
    """One request inside the replica; `started` once a batch took it, `cancelled` once its caller left."""

    segment: EncodedSegment
    request_id: str
    started: bool = False
    cancelled: bool = False


def resolve_device_and_dtype(use_gpu: bool, dtype: str) -> tuple[str, str]:
    """cuda when the replica was given a GPU fraction and sees a GPU, else cpu; `auto` dtype: fp16 on GPU."""
    device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
    if dtype != "auto":
        return device, dtype
    return device, "float16" if device == "cuda" else "float32"


@serve.deployment(name="Decoder", logging_config=STRUCTURED_LOGGING)
class Decoder:
    def __init__(
        self,
        model: str,
        *,
        use_gpu: bool,
        dtype: str,
        max_batch_size: int,
        batch_wait_timeout_s: float,
        memory_budget_gb: float | None = None,
    ) -> None:
        device, dtype = resolve_device_and_dtype(use_gpu, dtype)
        self.device = torch.device(device)
        self.stage = SpeechDecoderStage(load_model(model, dtype=dtype, device=device, components=("decoder",)))
        self.memory_budget_bytes = None if memory_budget_gb is None else int(memory_budget_gb * 2**30)
        gpu = GpuProbe(torch.cuda.current_device()) if self.device.type == "cuda" else None
        # NVML read about once a second in the background; None (busy time instead) without a GPU or NVML.
        sampler = gpu_utilization_sampler(gpu) if gpu is not None else None
        self.load = ReplicaLoadTracker(max_batch_size, gpu=gpu, sampler=sampler)
        self._gpu = gpu
        self.metrics = DecoderMetrics()
        self.metrics.utilization_from_busy_time.set(0 if sampler is not None else 1)
        self.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.set_max_batch_size(max_batch_size)
        logger.info("Decoder on %s in %s, max batch %d", device, dtype, self.max_batch_size)

    # --- runtime tuning -------------------------------------------------------------------------

    def set_max_batch_size(self, size: int) -> int:
        """Ask for batches of at most `size`; the memory budget may cap it. Returns the size applied."""
        self._requested_batch_size = size
        budget = self.memory_budget_bytes
        self.max_batch_size = size if budget is None else self.stage.max_batch_size_for_memory(budget, size)
        self.load.max_batch_size = self.max_batch_size
        self._decode_whole.set_max_batch_size(self.max_batch_size)
        self._decode_stream.set_max_batch_size(self.max_batch_size)
        return self.max_batch_size

    def set_batch_wait_timeout_s(self, timeout_s: float) -> None:
        self._decode_whole.set_batch_wait_timeout_s(timeout_s)
        self._decode_stream.set_batch_wait_timeout_s(timeout_s)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """`user_config` keys (all optional): max_batch_size, batch_wait_timeout_s, memory_budget_gb."""
        if "batch_wait_timeout_s" in user_config:
            self.set_batch_wait_timeout_s(float(user_config["batch_wait_timeout_s"]))
        if "memory_budget_gb" in user_config:
            self.memory_budget_bytes = int(float(user_config["memory_budget_gb"]) * 2**30)
        self.set_max_batch_size(int(user_config.get("max_batch_size", self._requested_batch_size)))

    # --- requests --------------------------------------------------------------------------------

    @contextmanager
    def _track(self, segment: EncodedSegment, request_id: str) -> Iterator[_Slot]:
        slot = _Slot(segment, request_id)
        self.load.request_accepted()
        self._publish_load()
        try:
            yield slot
        finally:
            slot.cancelled = True
            self.load.request_finished(waiting=not slot.started)
            self._publish_load()
            logger.info("segment done", extra={"request_id": request_id, "cancelled_while_queued": not slot.started})

    async def synthesize(self, segment: EncodedSegment, request_id: str = "") -> np.ndarray:
        """Whole-utterance audio [N] float32 of one segment, decoded in a dynamic batch."""
        with self._track(segment, request_id) as slot:
            result = await self._decode_whole(slot)
        if isinstance(result, CosyVoiceError):
            raise result
        return result

    async def stream(self, segment: EncodedSegment, request_id: str = "") -> AsyncIterator[np.ndarray]:
        """Audio chunks [n] float32 of one segment as they are decoded, in a batched stream."""
        with self._track(segment, request_id) as slot:
            async for (item,) in self._decode_stream(slot):
                if isinstance(item, CosyVoiceError):
                    raise item
                if item.size:
                    yield item

    def _start_batch(self, slots: list[_Slot], path: str) -> None:
        for slot in slots:
            slot.started = True
        self.load.record_batch(len(slots))
        self.metrics.batch_size.observe(len(slots), {"path": path})
        self._publish_load()
        # Batches run outside any one request's context: name their requests so logs can be joined.
        logger.info("batch started", extra={"path": path, "request_ids": [slot.request_id for slot in slots]})

    def _publish_load(self) -> None:
        self.metrics.queue_depth.set(self.load.waiting)
        self.metrics.ongoing.set(self.load.ongoing)
        allocated, reserved = self._gpu.memory_bytes() if self._gpu is not None else (0, 0)
        self.metrics.gpu_allocated.set(allocated)
        self.metrics.gpu_reserved.set(reserved)

    @serve.batch(max_batch_size=_INITIAL_BATCH_SIZE, batch_wait_timeout_s=_INITIAL_WAIT_S)
    async def _decode_whole(self, slots: list[_Slot]) -> list[np.ndarray | CosyVoiceError]:
        self._start_batch(slots, "whole")
        with self.load.busy():
            return await asyncio.to_thread(self.stage.decode_batch, [slot.segment for slot in slots])

    @serve.batch(max_batch_size=_INITIAL_BATCH_SIZE, batch_wait_timeout_s=_INITIAL_WAIT_S)
    async def _decode_stream(self, slots: list[_Slot]) -> AsyncIterator[list[Any]]:
        # Chunks travel wrapped in 1-tuples: Serve compares each slot with its stop sentinels,
        # which a bare multi-element array cannot answer.
        self._start_batch(slots, "stream")
        stream = self.stage.open_stream([slot.segment for slot in slots])
        steps = iter(stream)
        finished = [False] * len(slots)
        while not all(finished):
            for index, slot in enumerate(slots):
                if slot.cancelled and not finished[index]:
                    stream.cancel(index)
                    finished[index] = True
            with self.load.busy():
                step = await asyncio.to_thread(next, steps, None)
            if step is None:
                return
            outputs: list[Any] = []
            for index, item in enumerate(step):
                finished[index] = finished[index] or item is None
                outputs.append(StopIteration if finished[index] else (item,))
            yield outputs

    # --- health and load ---------------------------------------------------------------------------

    def ping(self) -> bool:
        return True

    async def check_health(self) -> None:
        """Serve's periodic probe: a tiny forward pass on the model's device; raising marks the replica unhealthy."""
        await asyncio.to_thread(self.stage.check_health)

    def batch_stats(self) -> dict[str, Any]:
        """Batch sizes seen since start ({size: count}) and the current max batch size."""
        return {"batch_size_counts": dict(self.load.batch_size_counts), "max_batch_size": self.max_batch_size}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The autoscaling policy's inputs (numbers only: anything else makes Serve stop collecting)."""
        self._publish_load()
        return self.load.snapshot()
