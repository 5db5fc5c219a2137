"""`LoopBridge`: a decoder replica's loop (`engine.runtime.scheduler.Scheduler`, on a thread of its own) seen from the
replica's asyncio event loop, where Serve's calls run.

Whole requests and streams enter a `@serve.batch` admission queue each, which hands every gathered batch to the loop
at once and returns, so admission never waits for decoding; the loop hands each request's audio back into the event
loop. The loop thread starts with the first request. An idle loop takes a request at once: the whole requests' queue
gathers arrivals for `batch_wait_timeout_s` only while the loop is busy, and a stream's never waits (its first audio is
what the deadline policy protects, and the loop takes it in at its next step anyway). Bi-streamed utterances enter the
loop directly, their text relayed in as it comes. The bridge keeps the replica's load (for the autoscaler) and its
gauges up to date.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import ray
from ray import serve
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError, TaskCancelledError

from autoscaling.metrics import GpuProbe, ReplicaLoadTracker
from deployments.text_relay import TextSessionClosedError
from engine.errors import CosyVoiceError, InvalidInputError, RequestFailedError, UnavailableError, as_request_error
from engine.runtime.bistream import BistreamStart
from engine.runtime.scheduler import Output, Scheduler, Ticket
from engine.runtime.segment import EncodedSegment
from observability.metrics import DecoderMetrics

logger = logging.getLogger("ray.serve")

GAUGE_REFRESH_S = 5.0  # well inside the time Ray keeps a gauge it was not given again
# Admission batches handed to the loop at once: two, so that one forming never waits for another (the loop takes a
# batch in at its next step, so more would only hold requests it has no slot for).
MAX_CONCURRENT_BATCHES = 2


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


class LoopBridge:
    """The replica's requests into `scheduler`'s loop and their audio back (see the module). `load` and `metrics`
    are the replica's; `gpu` (None on CPU) reports its memory; `busy_time_utilization`: the load's utilization is
    the loop's busy time (no GPU sampler)."""

    def __init__(
        self,
        scheduler: Scheduler,
        load: ReplicaLoadTracker,
        metrics: DecoderMetrics,
        max_batch_size: int,
        batch_wait_timeout_s: float,
        gpu: GpuProbe | None = None,
        busy_time_utilization: bool = True,
    ) -> None:
        self.scheduler, self.load, self.metrics, self.gpu = scheduler, load, metrics, gpu
        self.busy_time_utilization = busy_time_utilization
        # Built per replica, around its own `_admit_batch`. The loop starts idle: the queues wait for no batch to fill
        # until the loop is busy (`_loop_busy`).
        self._admit = {
            path: serve.batch(
                max_batch_size=max_batch_size, batch_wait_timeout_s=0.0, max_concurrent_batches=MAX_CONCURRENT_BATCHES
            )(self._admit_batch)
            for path in ("whole", "stream")
        }
        self.batch_wait_timeout_s = batch_wait_timeout_s
        self.loop_is_busy = False
        self._loop_thread: threading.Thread | None = None
        self.bistreams = 0  # bi-streamed utterances in the loop now
        self.set_max_batch_size(max_batch_size)

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
        return self.batch_wait_timeout_s if self.loop_is_busy else 0.0

    # --- requests --------------------------------------------------------------------------------

    async def whole(self, segment: EncodedSegment, request_id: str) -> np.ndarray:
        """Whole-utterance audio [N] float32 of one segment."""
        with self._track([segment], False, request_id) as slot:
            return np.concatenate([audio async for audio in self._outputs(slot)])

    async def stream(
        self, segments: list[EncodedSegment], request_id: str, later: list[ray.ObjectRef] | None
    ) -> AsyncIterator[np.ndarray]:
        """Audio chunks [n] float32 of a request's sentences as they are decoded, `later` ones joining as the
        encoder's calls return them."""
        with self._track(segments, True, request_id, later) as slot:
            async for chunk in self._outputs(slot):
                if chunk.size:
                    yield chunk

    async def bistream(
        self, start: BistreamStart, relay: ray.actor.ActorHandle, session: str, request_id: str
    ) -> AsyncIterator[np.ndarray]:
        """Audio chunks of one bi-streamed utterance, its text relayed in from `relay` (see `Decoder.bistream`)."""
        slot = _Slot([start.voice], True, request_id, asyncio.get_running_loop(), started=True)
        slot.ticket = self.scheduler.submit_bistream(start, slot.push)
        self._ensure_loop()
        self.bistreams += 1
        self.load.request_accepted(key=slot)
        self.publish_load()
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
            self.bistreams -= 1
            self.load.request_finished(waiting=False, key=slot)
            self.publish_load()

    @contextmanager
    def _track(
        self, segments: list[EncodedSegment], streaming: bool, request_id: str, later: list[ray.ObjectRef] | None = None
    ) -> Iterator[_Slot]:
        self.scheduler.limits.check_fits(segments)  # a request that can never fit is refused before it queues
        if later is not None and not (isinstance(later, list) and all(isinstance(r, ray.ObjectRef) for r in later)):
            raise InvalidInputError("later sentences come as a list of references to the encoder's calls")
        slot = _Slot(segments, streaming, request_id, asyncio.get_running_loop(), later or [])
        self.load.request_accepted(key=slot)
        self.publish_load()
        try:
            yield slot
        finally:
            if slot.ticket is not None and not slot.ticket.ended:
                self.scheduler.cancel(slot.ticket)  # the caller left: its slot frees at the next step
            self.load.request_finished(waiting=not slot.started, key=slot)
            self.publish_load()
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

    async def _relay_text(self, ticket: Ticket, relay: ray.actor.ActorHandle, session: str, request_id: str) -> None:
        """Hand the utterance's text pieces to the loop as the relay gives them, then its end; its session closed (its
        client left) cancels it, a relay that fails or a piece the loop refuses ends it with that error."""
        try:
            for index in itertools.count():  # a call sent again reads the session's pieces again from the first
                tokens = await relay.get.remote(session, index)
                self.scheduler.push_text(ticket, tokens)
                if tokens is None:
                    break
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
        self.publish_load()
        self._ensure_loop()
        return errors

    # --- the loop thread -------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        """Start the loop's thread, once (with the first request: the caller's event loop is the replica's)."""
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
        self.loop_is_busy = busy
        if busy:
            self.load.busy_started()
        else:
            self.load.busy_finished()
        self._admit["whole"].set_batch_wait_timeout_s(self.admission_wait_s)
        self.publish_load()

    # --- gauges ----------------------------------------------------------------------------------

    def keep_gauges_fresh(self) -> None:
        """Set the gauges again every GAUGE_REFRESH_S on a thread of its own: Ray exports a gauge only while it is set
        again and again, and one that stays unset drops out of the scrape (about 30 s after the last request), so
        dashboards would read "No data" instead of an idle 0."""

        def refresh() -> None:
            while True:
                self.publish_load()
                time.sleep(GAUGE_REFRESH_S)

        threading.Thread(target=refresh, name="gauges", daemon=True).start()

    def publish_load(self) -> None:
        metrics = self.metrics
        metrics.bistream_slots_free.set(self.max_batch_size - self.bistreams)
        metrics.utilization_from_busy_time.set(int(self.busy_time_utilization))
        metrics.queue_depth.set(self.load.waiting)
        metrics.ongoing.set(self.load.ongoing)
        metrics.live_limit.set(self.scheduler.live_limit)
        cache = self.scheduler.prompt_cache
        metrics.record_prompt_cache(cache.stats.hits, cache.stats.misses, cache.nbytes)
        allocated, reserved = self.gpu.memory_bytes() if self.gpu is not None else (0, 0)
        metrics.gpu_allocated.set(allocated)
        metrics.gpu_reserved.set(reserved)
