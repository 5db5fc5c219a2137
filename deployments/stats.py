"""Busy time, batch sizes and device load of a replica, for `record_autoscaling_stats` (names: autoscaling.metrics)."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class LoadWindow:
    """Busy time and batch sizes over a sliding window of `window_s` seconds."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._busy: deque[tuple[float, float]] = deque()  # finished busy intervals (start, end)
        self._busy_depth = 0  # overlapping busy sections (whole and streaming batches may overlap)
        self._busy_since = 0.0
        self._batches: deque[tuple[float, int]] = deque()
        self.batch_size_counts: Counter[int] = Counter()  # since start, for inspection

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Mark the replica busy while the block runs; nested or concurrent blocks count once."""
        if self._busy_depth == 0:
            self._busy_since = self._clock()
        self._busy_depth += 1
        try:
            yield
        finally:
            self._busy_depth -= 1
            if self._busy_depth == 0:
                self._busy.append((self._busy_since, self._clock()))

    def record_batch(self, size: int) -> None:
        self._batches.append((self._clock(), size))
        self.batch_size_counts[size] += 1

    def busy_fraction(self) -> float:
        now = self._clock()
        start = now - self.window_s
        while self._busy and self._busy[0][1] <= start:
            self._busy.popleft()
        busy = sum(end - max(begin, start) for begin, end in self._busy)
        if self._busy_depth:
            busy += now - max(self._busy_since, start)
        return min(1.0, busy / self.window_s)

    def mean_batch_size(self) -> float:
        start = self._clock() - self.window_s
        while self._batches and self._batches[0][0] < start:
            self._batches.popleft()
        return sum(size for _, size in self._batches) / len(self._batches) if self._batches else 0.0


def device_load(device: torch.device) -> tuple[float | None, float]:
    """(GPU utilization 0..1 from NVML, or None where unreadable; allocated / total memory) of `device`."""
    if device.type != "cuda":
        return None, 0.0
    total = torch.cuda.get_device_properties(device).total_memory
    memory = torch.cuda.memory_allocated(device) / total
    try:
        utilization = torch.cuda.utilization(device) / 100.0
    except (ModuleNotFoundError, RuntimeError):  # torch reads it through pynvml, which may be missing
        utilization = None
    return utilization, memory
