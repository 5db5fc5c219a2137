"""The `Decoder` deployment: speech-token LM + flow + vocoder on a GPU fraction (FP16), or on CPU (fp32).

One continuous-batching loop per replica (`engine.runtime.scheduler.Scheduler`) owns the model: whole-utterance
requests (`synthesize`), streams (`stream`) and bi-streamed utterances (`bistream`) go into it through the replica's
`LoopBridge` (`deployments.loop_bridge`: the `@serve.batch` admission queues, the loop's thread, the replica's load
and gauges). The loop admits requests between LLM steps within `max_batch_size` live sentences and the memory
budget; its flow + vocoder work runs on two more threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import ray
import torch
from ray import serve

from autoscaling.metrics import GpuProbe, ReplicaLoadTracker, gpu_utilization_sampler
from deployments.loop_bridge import LoopBridge
from engine.errors import CosyVoiceError
from engine.loading.loader import load_model
from engine.loading.model_source import LLM_CHECKPOINT_AUTO
from engine.nn.precision import FALLBACKS
from engine.runtime.bistream import BistreamStart
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.loop_report import loop_report
from engine.runtime.memory import device_memory_budget
from engine.runtime.playback import SchedulingPolicy
from engine.runtime.prompt_cache import DEFAULT_PROMPT_CACHE_SHARE, prompt_cache_bound
from engine.runtime.scheduler import Scheduler, Ticket
from engine.runtime.segment import EncodedSegment
from observability import STRUCTURED_LOGGING
from observability.metrics import DecoderMetrics

logger = logging.getLogger("ray.serve")


def resolve_device_and_dtype(use_gpu: bool, dtype: str) -> tuple[str, str]:
    """cuda when the replica was given a GPU fraction and sees a GPU, else cpu; `auto` stays `auto`: each module's
    precision is chosen at load for the model and the device (engine.nn.precision.decoder_dtypes: on a GPU float16,
    CosyVoice3 bfloat16; on CPU per stage from the CPU's units and the stage's size, `cpu_auto_choice`)."""
    device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
    return device, dtype


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
        memory_budget_gb: float | str | None = "auto",
        gpu_fraction: float | None = None,
        max_audio_s: float | None = None,
        max_request_s: float | None = None,
        policy: SchedulingPolicy | None = None,
        prompt_cache_share: float = DEFAULT_PROMPT_CACHE_SHARE,
        llm_checkpoint: str = LLM_CHECKPOINT_AUTO,
    ) -> None:
        """`policy`: the loop's order (None: `DeadlinePolicy`'s defaults); `prompt_cache_share`: the share of the memory
        budget its cache of prepared voice prompts may hold; `llm_checkpoint`: the LLM's checkpoint in an official
        model dir (`engine.loading.model_source.llm_checkpoint_file`)."""
        device, dtype = resolve_device_and_dtype(use_gpu, dtype)
        self.device = torch.device(device)
        if self.device.type == "cuda" and gpu_fraction:
            # Ray's GPU fraction is only a scheduling hint: cap this process so replicas sharing a card cannot
            # starve each other (the allocator raises OOM in this replica instead).
            torch.cuda.set_per_process_memory_fraction(gpu_fraction, self.device)
        loaded = load_model(model, dtype=dtype, device=device, components=("decoder",), llm_checkpoint=llm_checkpoint)
        self.stage = SpeechDecoderStage(loaded)
        self.gpu_fraction = gpu_fraction
        self.prompt_cache_share = prompt_cache_share
        budget = self._budget_bytes(memory_budget_gb)
        self.scheduler = Scheduler(
            self.stage,
            max_live=max_batch_size,
            memory_budget_bytes=budget,
            prompt_cache_bytes=prompt_cache_bound(budget, self.prompt_cache_share),
            max_audio_s=max_audio_s,
            max_request_s=max_request_s,
            policy=policy,
            on_request_end=self._request_ended,
            on_out_of_memory=self._out_of_memory,
        )
        gpu = GpuProbe(torch.cuda.current_device()) if self.device.type == "cuda" else None
        # NVML read about once a second in the background; None (busy time instead) without a GPU or NVML.
        sampler = gpu_utilization_sampler(gpu) if gpu is not None else None
        self.load = ReplicaLoadTracker(max_batch_size, gpu=gpu, sampler=sampler)
        self.metrics = DecoderMetrics()
        FALLBACKS.add_listener(self.metrics.record_precision_fallback)
        self.loop = LoopBridge(
            self.scheduler,
            self.load,
            self.metrics,
            max_batch_size,
            batch_wait_timeout_s,
            gpu=gpu,
            busy_time_utilization=sampler is None,
        )
        self.loop.keep_gauges_fresh()
        precision = self.stage.model.precision
        logger.info(
            "Decoder of %s (LLM checkpoint %s) on %s, precision %s (dtype %s: %s), max batch %d",
            loaded.name,
            loaded.llm_checkpoint or "none: dummy weights",
            device,
            precision.describe(),
            dtype,
            precision.reason or "as asked",
            max_batch_size,
        )

    # --- runtime tuning -------------------------------------------------------------------------

    def _budget_bytes(self, memory_budget_gb: float | str | None) -> int | None:
        """The loop's memory budget: `auto` from the device share (engine.runtime.memory.device_memory_budget)."""
        if memory_budget_gb == "auto":
            budget = device_memory_budget(self.device, self.gpu_fraction)
            if budget is not None:
                logger.info("memory budget auto: %.2f GiB for requests", budget / 2**30)
            return budget
        return None if memory_budget_gb is None else int(float(memory_budget_gb) * 2**30)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """`user_config` keys (all optional): max_batch_size, batch_wait_timeout_s, memory_budget_gb."""
        if "batch_wait_timeout_s" in user_config:
            self.loop.set_batch_wait_timeout_s(float(user_config["batch_wait_timeout_s"]))
        if "memory_budget_gb" in user_config:
            budget = self._budget_bytes(user_config["memory_budget_gb"])
            self.scheduler.limits.memory_budget_bytes = budget
            self.scheduler.prompt_cache.resize(prompt_cache_bound(budget, self.prompt_cache_share))
        if "max_batch_size" in user_config:
            self.loop.set_max_batch_size(int(user_config["max_batch_size"]))

    # --- requests --------------------------------------------------------------------------------

    async def synthesize(self, segment: EncodedSegment, request_id: str = "") -> np.ndarray:
        """Whole-utterance audio [N] float32 of one segment, decoded in the replica's loop."""
        return await self.loop.whole(segment, request_id)

    async def stream(
        self,
        segments: EncodedSegment | list[EncodedSegment],
        request_id: str = "",
        later: list[ray.ObjectRef] | None = None,
    ) -> AsyncIterator[np.ndarray]:
        """Audio chunks [n] float32 as they are decoded; a list of a request's sentences is pipelined in order.

        `later`: references to the encoder's calls that return the request's next sentences, in order (inside a list,
        so that Serve hands them on at once instead of resolving them first): the request decodes its first sentences
        meanwhile, and each later one joins it once it is encoded; an encoder error ends the request."""
        async for chunk in self.loop.stream(segments if isinstance(segments, list) else [segments], request_id, later):
            yield chunk

    async def bistream(
        self, start: BistreamStart, relay: ray.actor.ActorHandle, session: str, request_id: str = ""
    ) -> AsyncIterator[np.ndarray]:
        """One bi-streamed utterance (CosyVoice2/3): its text ids come through `relay` (a `TextRelay`, piece by piece
        until None); audio chunks as they are made. It is a request of the replica's loop like the others
        (`Scheduler.submit_bistream`: a slot, the memory budget, the ceilings, cancellation): its LM steps beside the
        batch, its chunks on the lanes.

        The call ends however the utterance does: its audio done, a ceiling passed (the loop ends it while it waits
        for text too), its session closed by the ingress (it ends quietly), or the call cancelled (the ingress
        cancels it when its client leaves)."""
        async for chunk in self.loop.bistream(start, relay, session, request_id):
            yield chunk

    def _request_ended(self, ticket: Ticket, error: CosyVoiceError | None) -> None:
        """On the loop thread: what the request's listener felt, exported."""
        playback = ticket.playback
        self.metrics.record_playback(ticket.streaming, playback.first_audio_s, playback.underruns, playback.min_slack_s)

    def _out_of_memory(self, live_limit: int) -> None:
        """On the loop thread: the loop ran out of GPU memory, put the work back and lowered its live limit (it logs
        it)."""
        self.metrics.out_of_memory.inc()
        self.metrics.live_limit.set(live_limit)

    # --- health and load ---------------------------------------------------------------------------

    def ping(self) -> bool:
        return True

    async def check_health(self) -> None:
        """Serve's periodic probe: the loop has not failed, and a tiny forward pass on the model's device; raising
        marks the replica unhealthy (Serve replaces it)."""
        if self.scheduler.failure is not None:
            raise RuntimeError(f"the decoder loop failed: {self.scheduler.failure!r}")
        await asyncio.to_thread(self.stage.check_health)

    def batch_stats(self) -> dict[str, Any]:
        """Admission batch sizes seen since start ({size: count}), the max batch size, and the loop's report
        (`engine.runtime.loop_report`)."""
        precision = self.stage.model.precision
        return {
            "batch_size_counts": dict(self.load.batch_size_counts),
            "max_batch_size": self.loop.max_batch_size,
            "loop_busy": self.loop.loop_is_busy,
            "admission_wait_s": self.loop.admission_wait_s,
            "precision": precision.describe(),
            "precision_reason": precision.reason,
            "bistreams": self.loop.bistreams,
            "device_peak_memory_bytes": torch.cuda.max_memory_allocated(self.device) if self.loop.gpu else None,
            **loop_report(self.scheduler),
        }

    def model_copies(self) -> dict[str, int]:
        """Distinct LLM modules and token generators the whole and the streaming paths drive (one of each)."""
        whole, streams = self.scheduler, self.scheduler.streams
        return {
            "llm_modules": len({id(self.stage.model.llm), id(whole.llm.model), id(streams.decoder.model.llm)}),
            "token_generators": len({id(whole.llm), id(streams.llm)}),
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The autoscaling policy's inputs (numbers only: anything else makes Serve stop collecting)."""
        self.loop.publish_load()
        return self.load.snapshot()
