"""The decoder replicas' autoscaling metrics contract, and a tracker that produces it.

A decoder replica returns `ReplicaLoadTracker.snapshot()` (a dict keyed by the names below) from its
`record_autoscaling_stats()` method; Serve aggregates each value over `look_back_period_s` and hands it
to the policy as `ctx.aggregated_metrics[name][replica_id]`. Both sides import these names.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

UTILIZATION = "utilization"
"""Fraction 0..1 of the last window the accelerator was busy: NVML GPU utilization where a GPU
exists, else the replica's busy-time fraction (time with at least one batch running)."""

QUEUE_DEPTH = "queue_depth"
"""Requests waiting inside the replica, accepted but not yet in a batch."""

ONGOING_REQUESTS = "ongoing_requests"
"""Requests accepted by the replica: waiting plus running."""

BATCH_FILL = "batch_fill"
"""Mean batch size / max batch size over the window, 0..1 (0 when no batch ran)."""

GPU_MEMORY_FRACTION = "gpu_memory_fraction"
"""Allocated / total GPU memory of the replica's device, 0 on CPU."""

METRIC_NAMES: tuple[str, ...] = (UTILIZATION, QUEUE_DEPTH, ONGOING_REQUESTS, BATCH_FILL, GPU_MEMORY_FRACTION)


class GpuProbe:
    """Reads GPU utilization (NVML) and memory (torch) for one device.

    `available` says whether NVML answers; memory is read through torch whenever CUDA is there.
    """

    def __init__(self, device_index: int = 0) -> None:
        self.device_index = device_index
        self._nvml_handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self._pynvml = pynvml
        except Exception:  # no NVML library or no GPU: utilization falls back to busy time
            self._nvml_handle = None

    @property
    def available(self) -> bool:
        return self._nvml_handle is not None

    def utilization(self) -> float:
        """NVML's utilization over its last sample period (1/6 s to 1 s), as a fraction."""
        return self._pynvml.nvmlDeviceGetUtilizationRates(self._nvml_handle).gpu / 100.0

    def memory_bytes(self) -> tuple[int, int]:
        """(allocated, reserved) bytes of torch's caching allocator on the device; (0, 0) without CUDA."""
        import torch

        if not torch.cuda.is_available():
            return 0, 0
        return torch.cuda.memory_allocated(self.device_index), torch.cuda.memory_reserved(self.device_index)

    def memory_fraction(self) -> float:
        import torch

        if not torch.cuda.is_available():
            return 0.0
        total = torch.cuda.get_device_properties(self.device_index).total_memory
        return self.memory_bytes()[0] / total


class ReplicaLoadTracker:
    """Counts a replica's requests and batches and reports the metrics contract.

    Call `request_accepted()` when a request enters the replica, `batch_started(n)` when n waiting
    requests enter a batch, `batch_finished()` when that batch ends and `request_finished()` when a
    request leaves. A replica whose batches are not busy all along (a streaming batch waits between
    steps) calls `record_batch(n)` when the batch forms and wraps the compute in `busy()` instead.
    Busy time is the union of busy sections (overlapping ones count once), measured over `window_s`.
    """

    def __init__(
        self,
        max_batch_size: int,
        window_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        gpu: GpuProbe | None = None,
    ) -> None:
        if max_batch_size < 1 or window_s <= 0:
            raise ValueError("max_batch_size must be >= 1 and window_s > 0")
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self._clock = clock
        self._gpu = gpu
        self.waiting = 0
        self.ongoing = 0
        self.batch_size_counts: Counter[int] = Counter()  # since start, for inspection
        self._busy_depth = 0
        self._busy_since: float | None = None
        self._busy_intervals: deque[tuple[float, float]] = deque()
        self._batch_sizes: deque[tuple[float, int]] = deque()
        self._utilization_samples: deque[tuple[float, float]] = deque()

    def request_accepted(self) -> None:
        self.waiting += 1
        self.ongoing += 1

    def record_batch(self, batch_size: int) -> None:
        """`batch_size` waiting requests entered a batch."""
        self.waiting = max(0, self.waiting - batch_size)
        self._batch_sizes.append((self._clock(), batch_size))
        self.batch_size_counts[batch_size] += 1

    def busy_started(self) -> None:
        if self._busy_depth == 0:
            self._busy_since = self._clock()
        self._busy_depth += 1

    def busy_finished(self) -> None:
        self._busy_depth = max(0, self._busy_depth - 1)
        if self._busy_depth == 0 and self._busy_since is not None:
            self._busy_intervals.append((self._busy_since, self._clock()))
            self._busy_since = None

    @contextmanager
    def busy(self) -> Iterator[None]:
        """The replica is busy while the block runs; nested or concurrent blocks count once."""
        self.busy_started()
        try:
            yield
        finally:
            self.busy_finished()

    def batch_started(self, batch_size: int) -> None:
        self.record_batch(batch_size)
        self.busy_started()

    def batch_finished(self) -> None:
        self.busy_finished()

    def request_finished(self, waiting: bool = False) -> None:
        """A request left; `waiting`: it left before any batch took it (cancelled while queued)."""
        self.ongoing = max(0, self.ongoing - 1)
        if waiting:
            self.waiting = max(0, self.waiting - 1)

    def busy_fraction(self) -> float:
        now = self._clock()
        start = now - self.window_s
        while self._busy_intervals and self._busy_intervals[0][1] <= start:
            self._busy_intervals.popleft()
        busy = sum(end - max(begin, start) for begin, end in self._busy_intervals)
        if self._busy_since is not None:
            busy += now - max(self._busy_since, start)
        return min(1.0, busy / self.window_s)

    def batch_fill(self) -> float:
        start = self._clock() - self.window_s
        while self._batch_sizes and self._batch_sizes[0][0] < start:
            self._batch_sizes.popleft()
        if not self._batch_sizes:
            return 0.0
        mean_size = sum(size for _, size in self._batch_sizes) / len(self._batch_sizes)
        return min(1.0, mean_size / self.max_batch_size)

    def utilization(self) -> float:
        if self._gpu is None or not self._gpu.available:
            return self.busy_fraction()
        # NVML reports a short recent period; average the samples taken at each snapshot over the window.
        now = self._clock()
        self._utilization_samples.append((now, self._gpu.utilization()))
        while self._utilization_samples[0][0] < now - self.window_s:
            self._utilization_samples.popleft()
        return sum(value for _, value in self._utilization_samples) / len(self._utilization_samples)

    def snapshot(self) -> dict[str, float]:
        """The dict a replica returns from `record_autoscaling_stats()` (every value a float)."""
        return {
            UTILIZATION: float(self.utilization()),
            QUEUE_DEPTH: float(self.waiting),
            ONGOING_REQUESTS: float(self.ongoing),
            BATCH_FILL: float(self.batch_fill()),
            GPU_MEMORY_FRACTION: float(self._gpu.memory_fraction()) if self._gpu is not None else 0.0,
        }
