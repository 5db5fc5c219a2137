"""Stream state that crosses CUDA streams: the one rule and the one helper (docs/scheduler.md, "CUDA streams").

On CUDA each vocoding lane of the decoder loop issues its kernels on a CUDA stream of its own, and a streaming
sentence's state (`engine.families.chunking.StreamState`) made by one lane's job may be read, replaced and freed by
the other lane's next job. Without a guard the reader may start before the writer's kernels are done, or the caching
allocator may reuse a dropped tensor's memory while the other lane's kernels still read it (a silent use-after-free).

The rule: a lane works on a stream state only after `take_over(state)` on its own thread (its stream waits for the
state's last event, and every CUDA tensor of the state is marked used on it, `Tensor.record_stream`), and a lane's
job ends with `hand_over(states)` (an event recorded on its stream). The LLM's KV cache lives on the loop thread's
stream, so every generator call runs `on_stream(loop_stream(device))` (`SharedGenerator`). On CPU both are no-ops.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from engine.llm.generation import GenerationRequest, TokenEvent, TokenGenerator


def state_tensors(state: Any) -> Iterator[Tensor]:
    """The tensors a stream state holds: its fields, and the fields of the objects it keeps (its vocoder stream)."""
    for value in vars(state).values():
        if isinstance(value, Tensor):
            yield value
        elif hasattr(value, "__dict__") and not isinstance(value, torch.Generator | type):
            yield from (v for v in vars(value).values() if isinstance(v, Tensor))


def _current_stream(tensors: list[Tensor]) -> Any:
    device = next((t.device for t in tensors if t.is_cuda), None)
    return None if device is None else torch.cuda.current_stream(device)


def take_over(state: Any, stream: Any = None) -> None:
    """The current thread's CUDA stream (or `stream`) takes over `state`: it waits for the work `hand_over` recorded
    on the stream that last wrote it, and each CUDA tensor of the state is recorded as used on it."""
    tensors = [t for t in state_tensors(state) if t.is_cuda]
    stream = stream if stream is not None else _current_stream(tensors)
    if stream is None:  # CPU, or nothing on the device yet
        return
    written = getattr(state, "written", None)
    if written is not None:
        stream.wait_event(written)
    for tensor in tensors:
        tensor.record_stream(stream)


def hand_over(states: Iterable[Any], device: torch.device | None = None) -> None:
    """The end of a lane's work on `states` (device: the decoder's): an event on the current CUDA stream, which the
    next `take_over` of each state waits for."""
    if device is None or device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    for state in states:
        state.written = event


def loop_stream(device: torch.device) -> Any:
    """The CUDA stream the loop thread issues the LLM's kernels on (the device's default stream); None on CPU."""
    return torch.cuda.default_stream(device) if device.type == "cuda" else None


def on_stream(stream: Any) -> AbstractContextManager[Any]:
    """Issue this thread's kernels on `stream` for the block (nothing to do for None: CPU)."""
    return nullcontext() if stream is None else torch.cuda.stream(stream)


class SharedGenerator:
    """The loop's token generator, locked: a lane may stop a stream (a non-finite chunk) while the loop thread steps
    the generator. Every call runs its kernels on the loop thread's CUDA stream, whichever thread makes it, so a lane
    that drops a generator row slices the KV cache in order with the LLM steps."""

    def __init__(self, generator: TokenGenerator, device: torch.device) -> None:
        self.generator = generator
        self.model = generator.model
        self._lock = threading.Lock()
        self._stream = loop_stream(device)

    @property
    def active(self) -> int:
        return self.generator.active

    @property
    def batch_size(self) -> int:
        return self.generator.batch_size

    def on_loop_stream(self) -> AbstractContextManager:
        """Run the caller's kernels on the loop's CUDA stream, in order with the LLM's steps."""
        return on_stream(self._stream)

    def add(self, request: GenerationRequest) -> int:
        with self._lock, on_stream(self._stream):
            return self.generator.add(request)

    def cancel(self, request_id: int) -> bool:
        with self._lock, on_stream(self._stream):
            return self.generator.cancel(request_id)

    def pause(self, request_ids: list[int], keep_cache: bool) -> None:
        with self._lock, on_stream(self._stream):
            self.generator.pause(request_ids, keep_cache)

    def resume(self, request_ids: list[int]) -> None:
        with self._lock, on_stream(self._stream):
            self.generator.resume(request_ids)

    def step(self) -> list[TokenEvent]:
        with self._lock, on_stream(self._stream):
            return self.generator.step()
