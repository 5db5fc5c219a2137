"""How much accelerator memory a request needs while it is decoded, so batches can be capped by bytes.

The estimate counts the tensors that grow with the request: the LLM's KV cache at the request's
maximum length, the flow's widest activations (CFG doubles the batch; attention scores are fp32), and
the vocoder's activations at the waveform rate. Weights are not included: they are paid once per replica.
Each family's module configs answer for their own tensors: the LLM config's `kv_cache_bytes_per_position`, the
flow config's `mel_frames_of` and `activation_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.families.base import ModelConfig
from engine.runtime.segment import EncodedSegment
from engine.text.frontend import SEGMENT_MAX_LEN

SAFETY_FACTOR = 1.5  # allocator fragmentation and short-lived temporaries
# What a replica's share keeps beside its weights and its requests' estimates: cuBLAS workspaces, the vocoding lanes'
# streams, allocator rounding. A tenth of the share, at least this much.
_RESERVE_FRACTION = 0.1
_MIN_RESERVE_BYTES = 256 << 20


@dataclass(frozen=True)
class MemoryEstimate:
    kv_cache_bytes: int
    flow_bytes: int
    vocoder_bytes: int

    @property
    def total_bytes(self) -> int:
        return int(SAFETY_FACTOR * (self.kv_cache_bytes + self.flow_bytes + self.vocoder_bytes))


def estimate_request_memory(
    config: ModelConfig,
    text_tokens: int,
    prompt_text_tokens: int = 0,
    prompt_speech_tokens: int = 0,
    max_token_text_ratio: float = 20.0,
    dtype_bytes: int = 2,
    speed: float = 1.0,
) -> MemoryEstimate:
    """Peak bytes of one request of `text_tokens` target text tokens, decoded with weights of `dtype_bytes`; a speed
    below 1 stretches the mel before the vocoder, which then makes that much more audio."""
    max_speech = int(text_tokens * max_token_text_ratio)
    sequence = 2 + prompt_text_tokens + text_tokens + prompt_speech_tokens + max_speech  # + sos, task id
    kv_cache = sequence * config.llm.kv_cache_bytes_per_position(dtype_bytes)

    frames = config.flow.mel_frames_of(prompt_speech_tokens + max_speech)
    flow_bytes = config.flow.activation_bytes(frames, dtype_bytes)

    hift = config.hift
    samples = int(frames / min(speed, 1.0)) * hift.hop
    # after the first upsampling every stage holds about base_channels * samples / hop values (channels halve
    # as the rate doubles); three resblocks' outputs and the source branch live at once: ~4 such tensors, fp32
    vocoder = 4 * (hift.base_channels // 2) * samples // hift.upsample_rates[0] * 4
    return MemoryEstimate(kv_cache_bytes=kv_cache, flow_bytes=flow_bytes, vocoder_bytes=vocoder)


def segment_memory(config: ModelConfig, segment: EncodedSegment, dtype_bytes: int) -> MemoryEstimate:
    """`estimate_request_memory` of one encoded sentence: its text and prompt lengths, its sampling's longest speech
    and its speed."""
    return estimate_request_memory(
        config,
        segment.text_len,
        prompt_text_tokens=len(segment.text_encoded) - segment.text_len,
        prompt_speech_tokens=max(len(segment.llm_prompt_speech_tokens), len(segment.flow_prompt_speech_tokens)),
        max_token_text_ratio=segment.sampling.max_token_text_ratio,
        dtype_bytes=dtype_bytes,
        speed=segment.speed,
    )


def share_for_budget(used_bytes: int, budget_bytes: int) -> int:
    """The smallest share of memory in which `memory_budget_for` leaves `budget_bytes` for requests beside
    `used_bytes` (its inverse: the reserve is a tenth of the share, at least _MIN_RESERVE_BYTES)."""
    needed = used_bytes + budget_bytes
    return max(math.ceil(needed / (1 - _RESERVE_FRACTION)), needed + _MIN_RESERVE_BYTES)


# What a decoder replica is planned for (serve_app.plan): live sentences of the split's longest text
# (SEGMENT_MAX_LEN tokens) that make about this much speech, each after a voice prompt of this length; the loop
# admits longer ones fewer at a time, and the budget holds at least one as long as the sampling allows.
PLANNED_SPEECH_S = 15.0
PLANNED_PROMPT_S = 10.0
PLANNED_PROMPT_TEXT_TOKENS = 30
# The CUDA context and the kernels CUDA loads into it: memory a replica's process holds outside its allocator's
# share. An estimate (PyTorch's context is a few hundred MiB, by GPU and CUDA version) until the GPU check measures it.
CUDA_CONTEXT_BYTES = 512 << 20


def planned_budget_bytes(config: ModelConfig, max_batch_size: int, dtype_bytes: int) -> int:
    """The memory budget a decoder replica's loop needs for `max_batch_size` planned sentences (PLANNED_SPEECH_S of
    speech each), and for at least one sentence of the split's longest text at the sampling's longest speech
    (`max_token_text_ratio` 20), which a smaller budget would refuse with 413."""
    rate = config.speech_token_rate
    prompt = {"prompt_text_tokens": PLANNED_PROMPT_TEXT_TOKENS, "prompt_speech_tokens": int(PLANNED_PROMPT_S * rate)}
    planned = estimate_request_memory(
        config,
        SEGMENT_MAX_LEN,
        max_token_text_ratio=PLANNED_SPEECH_S * rate / SEGMENT_MAX_LEN,
        dtype_bytes=dtype_bytes,
        **prompt,
    )
    longest = estimate_request_memory(config, SEGMENT_MAX_LEN, dtype_bytes=dtype_bytes, **prompt)
    return max(max_batch_size * planned.total_bytes, longest.total_bytes)


def memory_budget_for(share_bytes: int, used_bytes: int, where: str = "the decoder's device share") -> int:
    """The bytes a decoder's live requests may hold in `share_bytes` of memory of which `used_bytes` (the weights,
    on CPU everything the container holds) are taken: the rest less a reserve. ValueError, naming the sizes, when
    nothing is left."""
    reserve = max(_MIN_RESERVE_BYTES, int(share_bytes * _RESERVE_FRACTION))
    budget = share_bytes - used_bytes - reserve
    if budget <= 0:
        raise ValueError(
            f"{where} of {share_bytes / 2**30:.2f} GiB holds {used_bytes / 2**30:.2f} GiB in use (weights "
            f"included) and a {reserve / 2**30:.2f} GiB reserve: nothing is left for requests; give the replica "
            "more memory (a larger GPU fraction or container limit), a smaller dtype, or an explicit memory budget"
        )
    return budget


def device_memory_budget(device: torch.device, share: float | None) -> int | None:
    """The `auto` memory budget of a decoder whose weights are loaded on `device`. On CUDA: `share` (the replica's
    GPU fraction, its allocator's cap; None or 1: the whole card) of the card's memory, less the weights and a
    reserve. On CPU: what the process may still grow into (`host_memory`: its container's limit, else the host's
    memory) less what is in use now (this replica's weights included) and a reserve; None where that cannot be read."""
    if device.type != "cuda":
        host = host_memory()
        return None if host is None else memory_budget_for(*host, where="the memory this replica may use")
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = share if share is not None and 0 < share < 1 else 1.0
    return memory_budget_for(int(total * fraction), torch.cuda.memory_allocated(device))


@dataclass(frozen=True)
class HostMemory:
    """Where the memory of a process comes from: the cgroup filesystem and /proc/meminfo (paths, so tests can stand
    in their own files)."""

    cgroup_root: Path = Path("/sys/fs/cgroup")
    proc_self_cgroup: Path = Path("/proc/self/cgroup")
    meminfo: Path = Path("/proc/meminfo")

    def limit_and_use(self) -> tuple[int, int] | None:
        """(limit, in use) bytes: the tightest memory limit of this process's cgroup and its ancestors (v2
        `memory.max`, v1 `memory.limit_in_bytes`) with that cgroup's working set (usage less the inactive file cache
        the kernel reclaims first), capped by the host; with no limit, the host's MemTotal and what MemAvailable
        leaves of it. None where neither can be read (not Linux)."""
        host = self._host()
        limited = self._cgroup_limit()
        if limited is not None and (host is None or limited[0] < host[0]):
            return limited
        return host

    def _host(self) -> tuple[int, int] | None:
        try:
            fields = dict(line.split(":", 1) for line in self.meminfo.read_text().splitlines() if ":" in line)
            total, available = (int(fields[key].split()[0]) * 1024 for key in ("MemTotal", "MemAvailable"))
        except (OSError, KeyError, ValueError):
            return None
        return total, total - available

    def _cgroup_limit(self) -> tuple[int, int] | None:
        """The binding (lowest) limit on the path from this process's cgroup up to the root, with its use."""
        tightest: tuple[int, int] | None = None
        for directory, limit_file, usage_file, inactive_key in self._cgroup_dirs():
            try:
                text = (directory / limit_file).read_text().strip()
                if text == "max":  # v2: no limit here
                    continue
                limit = int(text)
                usage = int((directory / usage_file).read_text())
                stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines())
            except (OSError, ValueError):
                continue
            if tightest is None or limit < tightest[0]:
                tightest = (limit, max(0, usage - int(stat.get(inactive_key, 0))))
        return tightest

    def _cgroup_dirs(self) -> list[tuple[Path, str, str, str]]:
        """This process's memory cgroup directories, its own first, then each ancestor up to the mount's root (in a
        container with its own cgroup namespace, the root is the container's)."""
        try:
            lines = self.proc_self_cgroup.read_text().splitlines()
        except OSError:
            return []
        dirs = []
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2: one unified hierarchy
                base, files = self.cgroup_root, ("memory.max", "memory.current", "inactive_file")
            elif "memory" in controllers.split(","):
                base, files = (
                    self.cgroup_root / "memory",
                    ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
                )
            else:
                continue
            parts = Path(path).relative_to("/").parts
            dirs += [(base.joinpath(*parts[:depth]), *files) for depth in range(len(parts), -1, -1)]
        return dirs


def host_memory() -> tuple[int, int] | None:
    """(limit, in use) bytes of the memory this process may use: `HostMemory().limit_and_use()`."""
    return HostMemory().limit_and_use()


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is the allocator running out of device memory, or a request error it caused (its cause)."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or isinstance(error.__cause__, torch.cuda.OutOfMemoryError)


def describe_memory_limit(device: torch.device, budget_bytes: int | None) -> str:
    """The memory limit a decoder on `device` works within, in words for an error: on CUDA its process's share of
    the card (`set_per_process_memory_fraction`), and the budget its live requests may hold."""
    parts = []
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = torch.cuda.get_per_process_memory_fraction(device)
        parts.append(f"a {fraction * total / 2**30:.2f} GiB share ({fraction:g}) of the GPU's {total / 2**30:.1f} GiB")
    else:
        parts.append(f"the memory of its {device.type} device")
    if budget_bytes is not None:
        parts.append(f"a request budget of {budget_bytes / 2**20:.0f} MiB")
    return " with ".join(parts)
