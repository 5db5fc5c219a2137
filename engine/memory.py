"""How much accelerator memory a request needs while it is decoded, so batches can be capped by bytes.

The estimate counts the tensors that grow with the request: the LLM's KV cache at the request's
maximum length, the flow's widest activations (CFG doubles the batch; attention scores are fp32), and
the vocoder's activations at the waveform rate. Weights are not included: they are paid once per replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.flow import FlowConfig, mel_frames
from engine.flow_v3 import DiTFlowConfig
from engine.loader import ModelConfig
from engine.qwen2_llm import Qwen2LMConfig

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
    if isinstance(config.llm, Qwen2LMConfig):  # grouped-query attention caches only the key/value heads
        qwen = config.llm.qwen
        kv_width, layers = qwen.num_key_value_heads * qwen.head_dim, qwen.num_hidden_layers
    else:
        kv_width, layers = config.llm.llm.output_size, config.llm.llm.num_blocks
    kv_cache = 2 * layers * sequence * kv_width * dtype_bytes

    flow = config.flow
    speech_tokens = prompt_speech_tokens + max_speech
    if isinstance(flow, DiTFlowConfig):  # CosyVoice3: the DiT takes concat(x, cond, mu, speaker)
        dit = flow.estimator
        frames = speech_tokens * flow.token_mel_ratio
        in_channels, width, heads = 2 * dit.mel_dim + dit.mu_dim + dit.spk_dim, dit.dim, dit.heads
    else:
        estimator = flow.decoder.estimator
        if isinstance(flow, FlowConfig):
            frames = mel_frames(speech_tokens, flow.input_frame_rate)
            width = max(estimator.channels)
        else:
            frames = speech_tokens * flow.token_mel_ratio
            width = estimator.channels
        in_channels, heads = estimator.in_channels, estimator.num_heads
    cfg_rows = 2
    hidden = cfg_rows * frames * (in_channels + 4 * width) * dtype_bytes
    attention = cfg_rows * heads * frames * frames * 4
    flow_bytes = hidden + attention

    hift = config.hift
    samples = frames * hift.hop
    # after the first upsampling every stage holds about base_channels * samples / hop values (channels halve
    # as the rate doubles); three resblocks' outputs and the source branch live at once: ~4 such tensors, fp32
    vocoder = 4 * (hift.base_channels // 2) * samples // hift.upsample_rates[0] * 4
    return MemoryEstimate(kv_cache_bytes=kv_cache, flow_bytes=flow_bytes, vocoder_bytes=vocoder)
