"""How much accelerator memory a request needs while it is decoded, so batches can be capped by bytes.

The estimate counts the tensors that grow with the request: the LLM's KV cache at the request's
maximum length, the flow's widest activations (CFG doubles the batch; attention scores are fp32), and
the vocoder's activations at the waveform rate. Weights are not included: they are paid once per replica.
Each family's module configs answer for their own tensors: the LLM config's `kv_cache_bytes_per_position`, the
flow config's `mel_frames_of` and `activation_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.families.base import ModelConfig

_SAFETY_FACTOR = 1.5  # allocator fragmentation and short-lived temporaries
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
        return int(_SAFETY_FACTOR * (self.kv_cache_bytes + self.flow_bytes + self.vocoder_bytes))


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


def memory_budget_for(share_bytes: int, weights_bytes: int) -> int:
    """The bytes a decoder's live requests may hold in a device share of `share_bytes` that already holds
    `weights_bytes` of weights: the rest less a reserve. ValueError, naming the sizes, when nothing is left."""
    reserve = max(_MIN_RESERVE_BYTES, int(share_bytes * _RESERVE_FRACTION))
    budget = share_bytes - weights_bytes - reserve
    if budget <= 0:
        raise ValueError(
            f"the decoder's device share of {share_bytes / 2**30:.2f} GiB holds {weights_bytes / 2**30:.2f} GiB of "
            f"weights and a {reserve / 2**30:.2f} GiB reserve: nothing is left for requests; give the replica a "
            "larger GPU fraction, a smaller dtype, or an explicit memory budget"
        )
    return budget


def device_memory_budget(device: torch.device, share: float | None) -> int | None:
    """The `auto` memory budget of a decoder whose weights are loaded on `device`. On CUDA: `share` (the replica's
    GPU fraction, its allocator's cap; None or 1: the whole card) of the card's memory, less the weights and a
    reserve. On CPU None: host memory is not what bounds a CPU decoder, its cores are (`max_batch_size`)."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = share if share is not None and 0 < share < 1 else 1.0
    return memory_budget_for(int(total * fraction), torch.cuda.memory_allocated(device))


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
