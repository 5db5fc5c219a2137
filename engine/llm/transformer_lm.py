"""The CosyVoice v1 speech-token language model (`TransformerLM`), split into the two serving halves.

- Encoder side (CPU replicas): `TransformerLM.encode_text` = text_embedding -> causal Conformer text encoder ->
  text_encoder_affine_layer, over concat(prompt text, text).
- Decoder side: `TransformerLM.lm_input` builds the prefill sequence that `engine.llm.generation.TokenGenerator`
  decodes from; `TransformerLM.generate` runs a list of requests to completion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import CheckpointError, InvalidInputError
from engine.llm.generation import GenerationRequest, generate_tokens
from engine.llm.sampling import SamplingOptions, sampling_from_yaml
from engine.loading.yaml_config import ObjectSpec, expect_class
from engine.nn.conformer import EncoderConfig, RelPositionEncoder
from engine.nn.layers import Linear

SOS, TASK_ID = 0, 1  # rows of llm_embedding


@dataclass(frozen=True)
class LLMConfig:
    text_encoder_input_size: int
    llm_input_size: int
    llm_output_size: int
    text_token_size: int
    speech_token_size: int  # also the EOS id: llm_decoder has speech_token_size + 1 outputs
    spk_embed_dim: int
    text_encoder: EncoderConfig
    llm: EncoderConfig
    sampling: SamplingOptions  # the yaml's sampler settings: the default of requests that bring none

    @classmethod
    def from_yaml(cls, spec: ObjectSpec) -> LLMConfig:
        """The yaml `llm` node (class `TransformerLM`)."""
        expect_class(spec, "TransformerLM", "llm")
        for key in ("text_encoder_input_size", "llm_input_size", "llm_output_size", "text_token_size"):
            if key not in spec.kwargs:
                raise CheckpointError(f"the TransformerLM config has no {key}")
        text_encoder = EncoderConfig.from_yaml(spec["text_encoder"], spec["text_encoder_input_size"])
        llm = EncoderConfig.from_yaml(spec["llm"], spec["llm_input_size"])
        if text_encoder.input_size != spec["text_encoder_input_size"] or llm.input_size != spec["llm_input_size"]:
            raise CheckpointError("the TransformerLM encoders' input sizes disagree with its own")
        if llm.output_size != spec["llm_output_size"]:
            raise CheckpointError(f"llm output_size {llm.output_size} disagrees with llm_output_size")
        if not llm.causal:
            raise CheckpointError("the TransformerLM backbone must be causal (static_chunk_size: 1)")
        return cls(
            text_encoder_input_size=int(spec["text_encoder_input_size"]),
            llm_input_size=int(spec["llm_input_size"]),
            llm_output_size=int(spec["llm_output_size"]),
            text_token_size=int(spec["text_token_size"]),
            speech_token_size=int(spec.get("speech_token_size", 4096)),
            spk_embed_dim=int(spec.get("spk_embed_dim", 192)),
            text_encoder=text_encoder,
            llm=llm,
            sampling=sampling_from_yaml(spec.get("sampling")),
        )

    def kv_cache_bytes_per_position(self, dtype_bytes: int) -> int:
        """Bytes of keys and values one sequence position holds in the backbone's attention cache."""
        return 2 * self.llm.num_blocks * self.llm.output_size * dtype_bytes


class TransformerLM(nn.Module):
    """Module and parameter names follow the official class, so `llm.pt` loads strictly."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.text_embedding = nn.Embedding(cfg.text_token_size, cfg.text_encoder_input_size)
        self.text_encoder = RelPositionEncoder(cfg.text_encoder)
        self.text_encoder_affine_layer = Linear(cfg.text_encoder.output_size, cfg.llm_input_size)
        self.llm_embedding = nn.Embedding(2, cfg.llm_input_size)
        self.llm = RelPositionEncoder(cfg.llm)
        self.llm_decoder = Linear(cfg.llm_output_size, cfg.speech_token_size + 1)
        self.speech_embedding = nn.Embedding(cfg.speech_token_size, cfg.llm_input_size)
        self.spk_embed_affine_layer = Linear(cfg.spk_embed_dim, cfg.llm_input_size)

    @property
    def eos(self) -> int:
        return self.cfg.speech_token_size

    @property
    def speaker_embed_dim(self) -> int | None:
        return self.cfg.spk_embed_dim

    def encode_text(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """tokens [B, T] (right-padded ids of prompt text + text), lengths [B] -> [B, T, llm_input_size]."""
        if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < self.cfg.text_token_size:
            raise InvalidInputError(f"text token ids must be in [0, {self.cfg.text_token_size})")
        x = self.text_embedding(tokens.long())
        return self.text_encoder_affine_layer(self.text_encoder(x, lengths))

    def lm_input(self, request: GenerationRequest) -> Tensor:
        """The prefill sequence [S, llm_input_size]: sos, speaker term, encoded text, task id, prompt speech."""
        weight = self.llm_embedding.weight
        parts = [weight[SOS : SOS + 1]]
        embedding = request.embedding
        if embedding is not None and embedding.numel():
            unit = F.normalize(embedding.reshape(1, -1).float().to(weight.device), dim=1)
            parts.append(self.spk_embed_affine_layer(unit))
        parts += [request.text_encoded.to(weight.device), weight[TASK_ID : TASK_ID + 1]]
        if request.prompt_speech_tokens is not None:
            parts.append(self.speech_embedding(request.prompt_speech_tokens.long().to(weight.device).reshape(-1)))
        return torch.cat([part.to(weight.dtype) for part in parts])

    def prompt_prefix_rows(self, request: GenerationRequest) -> int:
        """sos, the speaker term, and the prompt text's rows of the encoded text, when the text encoder is causal
        (each row then depends on the rows before it alone, so the prompt text's on the prompt text alone); 0 without
        prompt text (two rows are not worth keeping)."""
        prompt_text = len(request.text_encoded) - request.text_len if self.cfg.text_encoder.causal else 0
        if not prompt_text:
            return 0
        embedding = request.embedding
        return 1 + int(embedding is not None and embedding.numel() > 0) + prompt_text

    def generate(self, requests: list[GenerationRequest]) -> list[Tensor]:
        """Decode all requests as one batch -> one LongTensor [N_i] of speech tokens each, in request order."""
        return generate_tokens(self, requests)
