"""How much accelerator memory a request needs while it is decoded, so batches can be capped by bytes.

The estimate counts the tensors that grow with the request: the LLM's KV cache at the request's
maximum length, the flow's widest activations (CFG doubles the batch; attention scores are fp32), and
the vocoder's activations at the waveform rate. Weights are not included: they are paid once per replica.
Each family's module configs answer for their own tensors: the LLM config's `kv_cache_bytes_per_position`, the
flow config's `mel_frames_of` and `activation_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.families.base import ModelConfig

_SAFETY_FACTOR = 1.5  # allocator fragmentation and short-lived temporaries


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
) -> MemoryEstimate:
    """Peak bytes of one request of `text_tokens` target text tokens, decoded with weights of `dtype_bytes`."""
    max_speech = int(text_tokens * max_token_text_ratio)
    sequence = 2 + prompt_text_tokens + text_tokens + prompt_speech_tokens + max_speech  # + sos, task id
    kv_cache = sequence * config.llm.kv_cache_bytes_per_position(dtype_bytes)

    frames = config.flow.mel_frames_of(prompt_speech_tokens + max_speech)
    flow_bytes = config.flow.activation_bytes(frames, dtype_bytes)

    hift = config.hift
    samples = frames * hift.hop
    # after the first upsampling every stage holds about base_channels * samples / hop values (channels halve
    # as the rate doubles); three resblocks' outputs and the source branch live at once: ~4 such tensors, fp32
    vocoder = 4 * (hift.base_channels // 2) * samples // hift.upsample_rates[0] * 4
    return MemoryEstimate(kv_cache_bytes=kv_cache, flow_bytes=flow_bytes, vocoder_bytes=vocoder)
