"""The decoder replicas' autoscaling metrics contract, and a tracker that produces it.

A decoder replica returns `ReplicaLoadTracker.snapshot()` (a dict keyed by the names below) from its
`record_autoscaling_stats()` method; Serve aggregates each value over `look_back_period_s` and hands it
to the policy as `ctx.aggregated_metrics[name][replica_id]`. Both sides import these names.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

UTILIZATION = "utilization"
"""Fraction 0..1 the accelerator was busy: where a GPU and NVML exist, the mean of the NVML readings a
background thread takes about once a second since the last stats call; else the replica's busy-time
fraction over the tracker's window (time with at least one batch running)."""

QUEUE_DEPTH = "queue_depth"
"""Requests waiting inside the replica, accepted but not yet in a batch."""

ONGOING_REQUESTS = "ongoing_requests"
"""Requests accepted by the replica: waiting plus running."""

BATCH_FILL = "batch_fill"
"""Mean batch size / max batch size over the window, 0..1 (0 when no batch ran)."""

GPU_MEMORY_FRACTION = "gpu_memory_fraction"
"""Allocated / total GPU memory of the replica's device, 0 on CPU."""

FIRST_AUDIO_WAIT_S = "first_audio_wait_s"
"""Seconds the oldest request of the replica that has no audio yet has waited since it entered the replica
(0 when none): a lower bound of its time to first audio, which grows as soon as the replica falls behind
(requests wait for a live slot inside the replica's loop, after `queue_depth` has counted them out)."""

logger = logging.getLogger("ray.serve")

METRIC_NAMES: tuple[str, ...] = (
    UTILIZATION,
    QUEUE_DEPTH,
    ONGOING_REQUESTS,
    BATCH_FILL,
    GPU_MEMORY_FRACTION,
    FIRST_AUDIO_WAIT_S,
)


def nvml_device_id(torch_index: int, torch_uuid: str | None, cuda_visible_devices: str | None) -> str | int:
    """How to find torch's device `torch_index` in NVML: its UUID ("GPU-..."), else an NVML index.

    NVML numbers every GPU of the machine by PCI bus, while torch's index counts only the devices
    `CUDA_VISIBLE_DEVICES` leaves (Ray sets it per replica), in CUDA's order; so the index alone names
    the wrong GPU whenever those differ. torch's own UUID is exact; without it, the visible-devices
    entry at `torch_index` (a UUID, or a physical index) is used.
    """
    if torch_uuid:
        return torch_uuid if torch_uuid.startswith(("GPU-", "MIG-")) else f"GPU-{torch_uuid}"
    entries = [entry.strip() for entry in (cuda_visible_devices or "").split(",") if entry.strip()]
    if torch_index >= len(entries):
        return torch_index
    entry = entries[torch_index]
    return int(entry) if entry.isdigit() else entry


class GpuProbe:
    """Reads GPU utilization (NVML) and memory (torch) for one torch CUDA device.

    `available` says whether NVML answers for it (`unavailable_reason` says why not); memory is read
    through torch whenever CUDA is there.
    """

    def __init__(self, device_index: int = 0) -> None:
        self.device_index = device_index
        self._nvml_handle = None
        self.unavailable_reason = ""
        try:
            import pynvml  # the nvidia-ml-py package (extra `gpu`)
            import torch

            uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
            device = nvml_device_id(device_index, str(uuid) if uuid else None, os.environ.get("CUDA_VISIBLE_DEVICES"))
            pynvml.nvmlInit()
            if isinstance(device, int):
                self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(device)
            else:
                self._nvml_handle = pynvml.nvmlDeviceGetHandleByUUID(device)
            self._pynvml = pynvml
        except Exception as exc:  # no nvidia-ml-py, no driver, or no such device
            self._nvml_handle = None
            self.unavailable_reason = f"{type(exc).__name__}: {exc}"

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


class UtilizationSampler:
    """Reads a utilization source about once a second in a daemon thread; `take_mean()` returns the mean
    of the readings since the previous call (the replica's stats period), so one NVML reading, which
    covers well under a second, does not stand for the whole period."""

    def __init__(self, read: Callable[[], float], interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self._read = read
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._total = 0.0
        self._count = 0
        self._last_mean: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="utilization-sampler", daemon=True)

    def start(self) -> UtilizationSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s)

    def sample(self) -> None:
        """Take one reading (the thread's step; callable directly)."""
        value = self._read()
        with self._lock:
            self._total += value
            self._count += 1

    def take_mean(self) -> float | None:
        """Mean of the readings since the last call; the last mean when none came in; None before any."""
        with self._lock:
            if self._count:
                self._last_mean = self._total / self._count
                self._total, self._count = 0.0, 0
            return self._last_mean

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # a failed read skips one sample; the next may succeed
                logger.debug("GPU utilization read failed", exc_info=True)


class ReplicaLoadTracker:
    """Counts a replica's requests and batches and reports the metrics contract.

    Call `request_accepted()` when a request enters the replica, `batch_started(n)` when n waiting
    requests enter a batch, `batch_finished()` when that batch ends and `request_finished()` when a
    request leaves. A replica whose batches are not busy all along (a streaming batch waits between
    steps) calls `record_batch(n)` when the batch forms and wraps the compute in `busy()` instead.
    Busy time is the union of busy sections (overlapping ones count once), measured over `window_s`.
    With a `sampler` (GPU utilization read in the background), `utilization` is its mean instead.
    """

    def __init__(
        self,
        max_batch_size: int,
        window_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        gpu: GpuProbe | None = None,
        sampler: UtilizationSampler | None = None,
    ) -> None:
        if max_batch_size < 1 or window_s <= 0:
            raise ValueError("max_batch_size must be >= 1 and window_s > 0")
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self._clock = clock
        self._gpu = gpu
        self._sampler = sampler
        self.waiting = 0
        self.ongoing = 0
        self.batch_size_counts: Counter[int] = Counter()  # since start, for inspection
        self._busy_depth = 0
        self._busy_since: float | None = None
        self._busy_intervals: deque[tuple[float, float]] = deque()
        self._batch_sizes: deque[tuple[float, int]] = deque()
        self._without_audio: dict[Hashable, float] = {}  # request key -> when accepted, oldest first

    def request_accepted(self, key: Hashable | None = None) -> None:
        """A request entered the replica; with a `key`, it counts in `first_audio_wait_s` until `first_audio(key)`
        or `request_finished(key=key)`."""
        self.waiting += 1
        self.ongoing += 1
        if key is not None:
            self._without_audio[key] = self._clock()

    def first_audio(self, key: Hashable) -> None:
        self._without_audio.pop(key, None)

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

    def request_finished(self, waiting: bool = False, key: Hashable | None = None) -> None:
        """A request left; `waiting`: it left before any batch took it (cancelled while queued)."""
        self.ongoing = max(0, self.ongoing - 1)
        if waiting:
            self.waiting = max(0, self.waiting - 1)
        if key is not None:
            self._without_audio.pop(key, None)

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

    def first_audio_wait_s(self) -> float:
        """How long the oldest request without audio has waited (dicts keep insertion order: the first is oldest)."""
        return self._clock() - next(iter(self._without_audio.values())) if self._without_audio else 0.0

    def utilization(self) -> float:
        """The sampler's mean since the last snapshot (NVML on a GPU), else the busy-time fraction."""
        sampled = self._sampler.take_mean() if self._sampler is not None else None
        return self.busy_fraction() if sampled is None else sampled

    def snapshot(self) -> dict[str, float]:
        """The dict a replica returns from `record_autoscaling_stats()` (every value a float)."""
        return {
            UTILIZATION: float(self.utilization()),
            QUEUE_DEPTH: float(self.waiting),
            ONGOING_REQUESTS: float(self.ongoing),
            BATCH_FILL: float(self.batch_fill()),
            GPU_MEMORY_FRACTION: float(self._gpu.memory_fraction()) if self._gpu is not None else 0.0,
            FIRST_AUDIO_WAIT_S: float(self.first_audio_wait_s()),
        }


def gpu_utilization_sampler(probe: GpuProbe, interval_s: float = 1.0) -> UtilizationSampler | None:
    """A started sampler of the probe's NVML utilization; None (logged once, here) when NVML is unavailable,
    in which case the replica reports its busy-time fraction as `utilization`."""
    if not probe.available:
        logger.warning(
            "NVML is unavailable for CUDA device %d (%s): autoscaling uses the replica's busy time as "
            "utilization; install nvidia-ml-py (extra `gpu`) on the GPU nodes",
            probe.device_index,
            probe.unavailable_reason,
        )
        return None
    return UtilizationSampler(probe.utilization, interval_s).start()
