"""The `Decoder` deployment: speech-token LM + flow + vocoder on a GPU fraction (FP16), or on CPU (fp32).

One continuous-batching loop per replica (`engine.runtime.scheduler.Scheduler`) owns the model: whole-utterance
requests (`synthesize`) and streaming ones (`stream`) enter one `@serve.batch` admission queue, which hands
each gathered batch to the loop at once and returns, so admission never waits for decoding. The loop runs
in a thread of its own (and its flow + vocoder work in two more); it admits requests between LLM steps
within `max_batch_size` live sentences and the memory budget. An idle loop takes a request at once: the
admission queue gathers arrivals for `batch_wait_timeout_s` only while the loop is busy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch
from ray import serve
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError, TaskCancelledError

from autoscaling.metrics import GpuProbe, ReplicaLoadTracker, gpu_utilization_sampler
from deployments.text_relay import TextSessionClosedError
from engine.errors import (
    CosyVoiceError,
    InvalidInputError,
    RequestFailedError,
    UnavailableError,
    as_request_error,
)
from engine.loading.loader import load_model
from engine.loading.model_source import LLM_CHECKPOINT_AUTO
from engine.nn.precision import FALLBACKS
from engine.runtime.bistream import BistreamStart
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.memory import device_memory_budget
from engine.runtime.playback import SchedulingPolicy
from engine.runtime.prompt_cache import DEFAULT_PROMPT_CACHE_SHARE, prompt_cache_bound
from engine.runtime.scheduler import Output, Scheduler, Ticket
from engine.runtime.segment import EncodedSegment
from observability import STRUCTURED_LOGGING
from observability.metrics import DecoderMetrics

logger = logging.getLogger("ray.serve")

GAUGE_REFRESH_S = 5.0  # well inside the time Ray keeps a gauge it was not given again


@dataclass(eq=False)
class _Slot:
    """One request inside the replica; `started` once an admission batch took it.

    The loop thread hands outputs over through `push`, thread-safely, into the caller's event loop."""

    segments: list[EncodedSegment]
    streaming: bool
    request_id: str
    loop: asyncio.AbstractEventLoop
    later: list[ray.ObjectRef] = field(default_factory=list)  # the encoder's calls for its next sentences, in order
    outputs: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)
    started: bool = False
    ticket: Ticket | None = None

    def push(self, item: Output) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)

    @property
    def path(self) -> str:
        return "stream" if self.streaming else "whole"


def later_sentences_error(exc: Exception) -> CosyVoiceError:
    """The error that ends a request whose later sentences did not come: the encoder's own error (looking through
    Ray's wrapping), 503 for a lost encoder replica (or its result, lost with its node) or a cancelled call, else a
    `RequestFailedError` (500)."""
    cause: BaseException = exc
    while isinstance(cause, RayTaskError):
        cause = cause.cause
    if isinstance(cause, CosyVoiceError):
        return cause
    if isinstance(cause, (RayActorError, ObjectLostError, TaskCancelledError)):
        return UnavailableError("the encoder failed while encoding this request's later sentences; retry")
    return as_request_error(exc)


def text_relay_error(exc: Exception) -> CosyVoiceError:
    """The error that ends a bi-streamed utterance whose text did not come: the loop's refusal of a piece, else 503
    (its session's relay failed: the ingress starts a new one for the next session)."""
    if isinstance(exc, CosyVoiceError):
        return exc
    return UnavailableError("the text relay of this session failed; retry")


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
        max_concurrent_batches: int = 2,
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
        self._gpu = gpu
        self.metrics = DecoderMetrics()
        FALLBACKS.add_listener(self.metrics.record_precision_fallback)
        self._utilization_from_busy_time = 0 if sampler is not None else 1
        # Built per replica so that max_concurrent_batches comes from the app's arguments. The loop starts idle:
        # the queues wait for no batch to fill until the loop is busy (`_loop_busy`), and a stream's never does:
        # its first audio is what the deadline policy protects, and the loop takes it in at its next step anyway.
        self._admit = {
            path: serve.batch(
                max_batch_size=max_batch_size, batch_wait_timeout_s=0.0, max_concurrent_batches=max_concurrent_batches
            )(self._admit_batch)
            for path in ("whole", "stream")
        }
        self.batch_wait_timeout_s = batch_wait_timeout_s
        self._loop_is_busy = False
        self._loop_thread: threading.Thread | None = None
        self._bistreams = 0  # bi-streamed utterances in the loop now (`bistream`)
        self.set_max_batch_size(max_batch_size)
        # Ray exports a gauge only while it is set again and again: one that stays unset drops out of the scrape
        # (about 30 s after the last request here), so dashboards would read "No data" instead of an idle 0.
        threading.Thread(target=self._refresh_gauges, name="gauges", daemon=True).start()
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

    def set_max_batch_size(self, size: int) -> int:
        """At most `size` sentences live in the loop (and per admission batch). Returns the size applied."""
        self.max_batch_size = size
        self.scheduler.limits.max_live = size
        self.load.max_batch_size = size
        for admit in self._admit.values():
            admit.set_max_batch_size(size)
        return size

    def set_batch_wait_timeout_s(self, timeout_s: float) -> None:
        """How long an admission batch of whole requests waits to fill while the loop is busy (an idle loop takes
        requests at once; streams never wait)."""
        self.batch_wait_timeout_s = timeout_s
        self._admit["whole"].set_batch_wait_timeout_s(self.admission_wait_s)

    @property
    def admission_wait_s(self) -> float:
        """The whole requests' admission wait now."""
        return self.batch_wait_timeout_s if self._loop_is_busy else 0.0

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
            self.set_batch_wait_timeout_s(float(user_config["batch_wait_timeout_s"]))
        if "memory_budget_gb" in user_config:
            budget = self._budget_bytes(user_config["memory_budget_gb"])
            self.scheduler.limits.memory_budget_bytes = budget
            self.scheduler.prompt_cache.resize(prompt_cache_bound(budget, self.prompt_cache_share))
        if "max_batch_size" in user_config:
            self.set_max_batch_size(int(user_config["max_batch_size"]))

    # --- requests --------------------------------------------------------------------------------

    @contextmanager
    def _track(
        self, segments: list[EncodedSegment], streaming: bool, request_id: str, later: list[ray.ObjectRef] | None = None
    ) -> Iterator[_Slot]:
        self.scheduler.limits.check_fits(segments)  # a request that can never fit is refused before it queues
        if later is not None and not (isinstance(later, list) and all(isinstance(r, ray.ObjectRef) for r in later)):
            raise InvalidInputError("later sentences come as a list of references to the encoder's calls")
        slot = _Slot(segments, streaming, request_id, asyncio.get_running_loop(), later or [])
        self.load.request_accepted(key=slot)
        self._publish_load()
        try:
            yield slot
        finally:
            if slot.ticket is not None and not slot.ticket.ended:
                self.scheduler.cancel(slot.ticket)  # the caller left: its slot frees at the next step
            self.load.request_finished(waiting=not slot.started, key=slot)
            self._publish_load()
            logger.info("segment done", extra={"request_id": request_id, "cancelled_while_queued": not slot.started})

    async def _outputs(self, slot: _Slot) -> AsyncIterator[np.ndarray]:
        """Hand the slot to the loop and yield its audio as it comes; an engine error is raised."""
        error = await self._admit[slot.path](slot)
        if error is not None:
            raise error
        taking_later = asyncio.create_task(self._take_later_sentences(slot)) if slot.later else None
        try:
            async for audio in self._audio(slot):
                yield audio
        finally:
            if taking_later is not None:
                taking_later.cancel()  # the request ended or its caller left: its later sentences are not awaited

    async def _audio(self, slot: _Slot) -> AsyncIterator[np.ndarray]:
        """The audio the loop hands the slot, until its end; the error that ended it is raised."""
        while (item := await slot.outputs.get()) is not None:
            self.load.first_audio(slot)  # its time to first audio is known: it no longer counts as waiting
            if isinstance(item, RequestFailedError):  # its cause stays here: the client gets a 500 with the id
                cause, request_id = item.__cause__, slot.request_id
                logger.error("request failed in the decoder loop", exc_info=cause, extra={"request_id": request_id})
            if isinstance(item, CosyVoiceError):
                raise item
            yield item

    async def _take_later_sentences(self, slot: _Slot) -> None:
        """Hand the request's later sentences to the loop as the encoder's calls return them; a failure (the
        encoder's, or a sentence the loop refuses, as it would have refused it at submission) ends the request."""
        assert slot.ticket is not None
        try:
            for index, later in enumerate(slot.later):
                segments = await later
                self.scheduler.extend(slot.ticket, segments, final=index == len(slot.later) - 1)
        except Exception as exc:
            self.scheduler.abort(slot.ticket, later_sentences_error(exc))

    async def synthesize(self, segment: EncodedSegment, request_id: str = "") -> np.ndarray:
        """Whole-utterance audio [N] float32 of one segment, decoded in the replica's loop."""
        with self._track([segment], False, request_id) as slot:
            return np.concatenate([audio async for audio in self._outputs(slot)])

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
        segments = segments if isinstance(segments, list) else [segments]
        with self._track(segments, True, request_id, later) as slot:
            async for chunk in self._outputs(slot):
                if chunk.size:
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
        slot = _Slot([start.voice], True, request_id, asyncio.get_running_loop(), started=True)
        slot.ticket = self.scheduler.submit_bistream(start, slot.push)
        self._ensure_loop()
        self._bistreams += 1
        self.load.request_accepted(key=slot)
        self._publish_load()
        logger.info("bi-streamed utterance started", extra={"request_id": request_id})
        relaying = asyncio.create_task(self._relay_text(slot.ticket, relay, session, request_id))
        try:
            async for chunk in self._audio(slot):
                if chunk.size:
                    yield chunk
        finally:
            relaying.cancel()
            if not slot.ticket.ended:
                self.scheduler.cancel(slot.ticket)
            self._bistreams -= 1
            self.load.request_finished(waiting=False, key=slot)
            self._publish_load()

    async def _relay_text(self, ticket: Ticket, relay: ray.actor.ActorHandle, session: str, request_id: str) -> None:
        """Hand the utterance's text pieces to the loop as the relay gives them, then its end; its session closed (its
        client left) cancels it, a relay that fails or a piece the loop refuses ends it with that error."""
        try:
            while (tokens := await relay.get.remote(session)) is not None:
                self.scheduler.push_text(ticket, tokens)
            self.scheduler.push_text(ticket, None)
        except TextSessionClosedError:  # its client left: nobody listens for the rest
            logger.info("bi-streamed utterance ended: its session was closed", extra={"request_id": request_id})
            self.scheduler.cancel(ticket)
        except Exception as exc:
            self.scheduler.abort(ticket, text_relay_error(exc))

    async def _admit_batch(self, slots: list[_Slot]) -> list[CosyVoiceError | None]:
        """An admission batch: hand every request to the loop (a refusal comes back as its error)."""
        errors: list[CosyVoiceError | None] = []
        for slot in slots:
            slot.started = True
            try:
                slot.ticket = self.scheduler.submit(slot.segments, slot.streaming, slot.push, complete=not slot.later)
                errors.append(None)
            except CosyVoiceError as exc:  # the budget shrank since the request's own check
                errors.append(exc)
        self.load.record_batch(len(slots))
        for path in ("whole", "stream"):
            ids = [slot.request_id for slot in slots if slot.path == path]
            if ids:
                self.metrics.batch_size.observe(len(ids), {"path": path})
                # Batches run outside any one request's context: name their requests so logs can be joined.
                logger.info("batch started", extra={"path": path, "request_ids": ids})
        self._publish_load()
        self._ensure_loop()
        return errors

    def _ensure_loop(self) -> None:
        """The replica's decoding loop, started on its first request in a thread of its own: steps back to back while
        there is work, asleep when there is none (no thread hop per step)."""
        if self._loop_thread is not None:
            return
        event_loop = asyncio.get_running_loop()

        def on_busy(busy: bool) -> None:
            event_loop.call_soon_threadsafe(self._loop_busy, busy)

        def on_error(exc: Exception) -> CosyVoiceError:
            # A fault no single request explains (a request's own end it alone): the loop's state is suspect, so
            # every request in it ends with a 503 and the loop stops; the health check then has Serve replace us.
            logger.error("decoder loop step failed; the replica will be replaced", exc_info=exc)
            self.metrics.loop_failures.inc()
            return UnavailableError("the decoder replica failed while serving this request; retry")

        self._loop_thread = threading.Thread(
            target=self.scheduler.run, args=(on_busy, on_error), name="decoder-loop", daemon=True
        )
        self._loop_thread.start()

    def _loop_busy(self, busy: bool) -> None:
        """The loop started or ran out of work: busy time for the autoscaler, and the admission queue's wait."""
        self._loop_is_busy = busy
        if busy:
            self.load.busy_started()
        else:
            self.load.busy_finished()
        self._admit["whole"].set_batch_wait_timeout_s(self.admission_wait_s)
        self._publish_load()

    def _request_ended(self, ticket: Ticket, error: CosyVoiceError | None) -> None:
        """On the loop thread: what the request's listener felt, exported."""
        playback = ticket.playback
        self.metrics.record_playback(ticket.streaming, playback.first_audio_s, playback.underruns, playback.min_slack_s)

    def _out_of_memory(self, live_limit: int) -> None:
        """On the loop thread: the loop ran out of GPU memory, put the work back and lowered its live limit (it logs
        it)."""
        self.metrics.out_of_memory.inc()
        self.metrics.live_limit.set(live_limit)

    def _refresh_gauges(self) -> None:
        while True:
            self._publish_load()
            time.sleep(GAUGE_REFRESH_S)

    def _publish_load(self) -> None:
        self.metrics.bistream_slots_free.set(self.max_batch_size - self._bistreams)
        self.metrics.utilization_from_busy_time.set(self._utilization_from_busy_time)
        self.metrics.queue_depth.set(self.load.waiting)
        self.metrics.ongoing.set(self.load.ongoing)
        self.metrics.live_limit.set(self.scheduler.live_limit)
        cache = self.scheduler.prompt_cache
        self.metrics.record_prompt_cache(cache.stats.hits, cache.stats.misses, cache.nbytes)
        allocated, reserved = self._gpu.memory_bytes() if self._gpu is not None else (0, 0)
        self.metrics.gpu_allocated.set(allocated)
        self.metrics.gpu_reserved.set(reserved)

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
        """Admission batch sizes seen since start ({size: count}), the max batch size, and the loop's stats."""
        stats = self.scheduler.stats
        return {
            "batch_size_counts": dict(self.load.batch_size_counts),
            "max_batch_size": self.max_batch_size,
            "max_vocode_batch": self.scheduler.max_vocode_batch,
            "llm_batch_size_counts": dict(stats.llm_batch_size_counts),
            "loop_busy": self._loop_is_busy,
            "admission_wait_s": self.admission_wait_s,
            "joined_running_batch": stats.joined_running_batch,
            "mixed_steps": stats.mixed_steps,
            "pipelined_sentences": stats.pipelined_sentences,
            "vocode_batch_size_counts": dict(stats.vocode_batch_size_counts),
            "llm_steps_while_vocoding": stats.llm_steps_while_vocoding,
            "first_lane_chunks": stats.first_lane_chunks,
            "admitted": stats.admitted,
            "cancelled": stats.cancelled,
            "request_faults": stats.request_faults,
            "policy": self.scheduler.policy.name,
            "precision": self.stage.model.precision.describe(),
            "precision_reason": self.stage.model.precision.reason,
            "preempted": stats.preempted,
            "resumed": stats.resumed,
            "held_for_first_audio": stats.held_for_first_audio,
            "over_limit": stats.over_limit,
            "out_of_memory": stats.out_of_memory,
            "oom_paused": stats.oom_paused,
            "oom_ended": stats.oom_ended,
            "live_limit": self.scheduler.live_limit,
            "loop_failed": self.scheduler.failure is not None,
            "bistreams": self._bistreams,
            "live": self.scheduler.live,
            "queued": self.scheduler.queued,
            "awaiting_sentences": self.scheduler.awaiting_sentences,
            "live_bytes": self.scheduler.live_bytes,
            "memory_budget_bytes": self.scheduler.limits.memory_budget_bytes,
            "prompt_cache": {
                "hits": self.scheduler.prompt_cache.stats.hits,
                "misses": self.scheduler.prompt_cache.stats.misses,
                "evictions": self.scheduler.prompt_cache.stats.evictions,
                "entries": len(self.scheduler.prompt_cache),
                "bytes": self.scheduler.prompt_cache.nbytes,
                "max_bytes": self.scheduler.prompt_cache.max_bytes,
            },
            "device_peak_memory_bytes": torch.cuda.max_memory_allocated(self.device) if self._gpu else None,
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
        self._publish_load()
        return self.load.snapshot()
