"""The CosyVoice2 speech-token language model (`Qwen2LM`): a Qwen2 decoder over text and speech embeddings.

- Encoder side: `Qwen2LM.encode_text` is only the Qwen2 token-embedding lookup (the official code feeds
  `embed_tokens(prompt text + text)` straight into the LM; there is no separate text encoder).
- Decoder side: the `TokenGenerator` (engine.llm.generation) drives this model too, with the same `GenerationRequest`
  and continuous batching. The LM input is sos, text embeddings, task id, prompt speech embeddings (no speaker
  term); every sampled id >= speech_token_size (EOS and the two other special ids) stops a request. Before
  min_len only EOS is masked, as in the official code (`SamplingOptions.mask_all_stop_ids_before_min_len`
  masks all three).

The Qwen2 decoder (grouped-query attention with RoPE, RMSNorm, SwiGLU MLP) is written here, without
transformers; its hyperparameters come from `CosyVoice-BlankEN/config.json` in the model directory. RoPE positions
are counted per sequence over the valid cache columns, so left padding in a batch does not shift them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import CheckpointError, InvalidInputError
from engine.llm.generation import GenerationRequest, generate_tokens
from engine.llm.sampling import SamplingOptions, sampling_from_yaml
from engine.llm.transformer_lm import SOS, TASK_ID
from engine.loading.yaml_config import ObjectSpec, expect_class
from engine.nn.conformer import KVCache, attention_mask
from engine.nn.layers import Linear, length_mask, softmax_fp32

QWEN_DIR = "CosyVoice-BlankEN"  # the official CosyVoice2 class points qwen_pretrain_path here
NUM_SPECIAL_SPEECH_TOKENS = 3  # EOS (= speech_token_size), +1, +2 (fill token): all stop plain decoding


@dataclass(frozen=True)
class Qwen2Config:
    """The Qwen2 hyperparameters CosyVoice2 uses, from a transformers `config.json`."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise CheckpointError(
                f"Qwen2 hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"Qwen2 num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"Qwen2 head_dim {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, path: Path) -> Qwen2Config:
        if not path.is_file():
            raise CheckpointError(f"Qwen2 config {path} is missing")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"Qwen2 config {path} cannot be read: {exc}") from exc
        if not isinstance(raw, dict) or raw.get("model_type", "qwen2") != "qwen2":
            raise CheckpointError(f"{path} is not a Qwen2 config (model_type {raw.get('model_type')!r})")
        unsupported = {
            "hidden_act": (raw.get("hidden_act", "silu"), "silu"),
            "use_sliding_window": (raw.get("use_sliding_window", False), False),
            "rope_scaling": (raw.get("rope_scaling"), None),
        }
        for key, (value, supported) in unsupported.items():
            if value != supported:
                raise CheckpointError(f"Qwen2 config {path}: {key}={value!r} is not supported (only {supported!r})")
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [key for key in required if key not in raw]
        if missing:
            raise CheckpointError(f"Qwen2 config {path} has no {', '.join(missing)}")
        head_dim = raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
        if head_dim * raw["num_attention_heads"] != raw["hidden_size"]:
            raise CheckpointError(f"Qwen2 config {path}: head_dim {head_dim} * heads must equal hidden_size")
        return cls(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw.get("num_key_value_heads", raw["num_attention_heads"])),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )


@dataclass(frozen=True)
class Qwen2LMConfig:
    llm_input_size: int
    llm_output_size: int
    speech_token_size: int  # also the EOS id: llm_decoder has speech_token_size + 3 outputs
    qwen: Qwen2Config
    sampling: SamplingOptions  # the yaml's sampler settings: the default of requests that bring none
    mix_ratio: tuple[int, int] = (5, 15)  # bi-streaming: text tokens, then speech tokens, per group (official default)

    @classmethod
    def from_yaml(cls, spec: ObjectSpec, model_dir: str | Path, class_name: str = "Qwen2LM") -> Qwen2LMConfig:
        """The yaml `llm` node (class `class_name`: the CosyVoice2 `Qwen2LM`, or v3's `CosyVoice3LM`); the Qwen2
        config is `<model_dir>/CosyVoice-BlankEN/config.json`."""
        expect_class(spec, class_name, "llm")
        expect_class(spec.get("llm"), "Qwen2Encoder", f"{class_name} backbone")
        for key in ("llm_input_size", "llm_output_size", "speech_token_size"):
            if key not in spec.kwargs:
                raise CheckpointError(f"the {class_name} config has no {key}")
        qwen = Qwen2Config.from_json(Path(model_dir) / QWEN_DIR / "config.json")
        sizes = (spec["llm_input_size"], spec["llm_output_size"])
        if any(size != qwen.hidden_size for size in sizes):
            raise CheckpointError(f"{class_name} llm_input/output_size {sizes} disagree with Qwen2 hidden_size")
        return cls(
            llm_input_size=int(spec["llm_input_size"]),
            llm_output_size=int(spec["llm_output_size"]),
            speech_token_size=int(spec["speech_token_size"]),
            qwen=qwen,
            sampling=sampling_from_yaml(spec.get("sampling")),
            mix_ratio=mix_ratio_from_yaml(spec.kwargs.get("mix_ratio", (5, 15)), class_name),
        )

    def kv_cache_bytes_per_position(self, dtype_bytes: int) -> int:
        """Bytes of keys and values one sequence position holds in the cache (grouped-query attention caches only
        the key/value heads)."""
        qwen = self.qwen
        return 2 * qwen.num_hidden_layers * qwen.num_key_value_heads * qwen.head_dim * dtype_bytes


def mix_ratio_from_yaml(value: object, class_name: str) -> tuple[int, int]:
    """The yaml's `mix_ratio` [text, speech]: two positive integers."""
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise CheckpointError(f"{class_name} mix_ratio must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """x [..., D] -> [..., D], computed in fp32."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).type(x.dtype)


def rotary_angles(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """positions [B, T] -> (cos, sin) [B, 1, T, head_dim] fp32, frequencies repeated over both halves.

    Computed per call in fp32 (never stored in the module), so a half-precision model keeps exact angles.
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, head_dim] rotated by the angles (in fp32) -> same shape and dtype."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat([-second, first], dim=-1) * sin).type(x.dtype)


class Qwen2Attention(nn.Module):
    """Grouped-query attention: q/k/v with bias, o without; each key/value head serves a group of query heads."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, rotary: tuple[Tensor, Tensor], mask: Tensor, cache: KVCache, block: int) -> Tensor:
        """x [B, Tq, D], rotary cos/sin [B, 1, Tq, head_dim], mask [B, Tq, Tk] -> [B, Tq, D].

        The Tq new keys/values (after RoPE) are written to `cache`, whose Tk columns end with them.
        """
        batch, queries, _ = x.shape
        q = self.q_proj(x).view(batch, queries, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, queries, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, queries, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        k, v = cache.store(block, k, v)
        # Query heads h*g .. h*g+g-1 share key/value head h: group them instead of repeating the cache.
        group = self.heads // self.kv_heads
        q = q.reshape(batch, self.kv_heads, group * queries, self.head_dim) * self.head_dim**-0.5
        scores = torch.matmul(q, k.transpose(-1, -2)).view(batch, self.kv_heads, group, queries, -1)
        weights = softmax_fp32(scores.masked_fill(~mask[:, None, None], float("-inf")), dim=-1)
        out = torch.matmul(weights.view(batch, self.kv_heads, group * queries, -1).to(v.dtype), v)
        out = out.view(batch, self.heads, queries, self.head_dim).transpose(1, 2).flatten(2)
        return self.o_proj(out)


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, T, D] -> [B, T, D]: down(silu(gate(x)) * up(x))."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(RMSNorm(x)), then x + MLP(RMSNorm(x))."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(cfg)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, rotary: tuple[Tensor, Tensor], mask: Tensor, cache: KVCache, block: int) -> Tensor:
        """x [B, Tq, D] -> [B, Tq, D] (see `Qwen2Attention.forward`)."""
        x = x + self.self_attn(self.input_layernorm(x), rotary, mask, cache, block)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen2ForCausalLM(nn.Module):
    """Holds the decoder and the (unused, usually tied) text `lm_head`, so the official keys load."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Model(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class Qwen2Encoder(nn.Module):
    """The official wrapper name (`llm.model.*` keys); runs the decoder over embeddings with a KV cache."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Qwen2ForCausalLM(cfg)

    def new_cache(self, batch: int, device: torch.device | str = "cpu") -> KVCache:
        return KVCache(self.cfg.num_hidden_layers, batch, device)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        """x [B, T, D] embeddings (right-padded), lengths [B] -> [B, T, D] last hidden states (after the final
        norm), causal. Padded positions never influence valid ones; their own outputs are unspecified (finite)."""
        valid = length_mask(lengths.to(x.device), x.shape[1])
        return self.forward_incremental(x, valid, self.new_cache(x.shape[0], x.device))

    def forward_incremental(self, x: Tensor, valid: Tensor, cache: KVCache) -> Tensor:
        """The next positions of every sequence in `cache`: x [B, T_new, D] embeddings, valid [B, T_new] bool
        (False = padding) -> [B, T_new, D] hidden states after the final RMSNorm; keys/values join `cache`.

        A prefill is a call on an empty cache (left-pad the inputs); a decode step is a call with T_new = 1.
        A position's RoPE index is the number of valid columns before it in its own row.
        """
        cache.extend(valid.to(cache.valid.device))
        seen = cache.valid[:, : cache.length]
        positions = (seen.long().cumsum(dim=1) - 1).clamp(min=0)[:, -x.shape[1] :]
        rotary = rotary_angles(positions.to(x.device), self.cfg.head_dim, self.cfg.rope_theta)
        mask = attention_mask(seen, cache.length - x.shape[1], causal=True)
        decoder = self.model.model
        x = x.to(decoder.embed_tokens.weight.dtype)
        for index, layer in enumerate(decoder.layers):
            x = layer(x, rotary, mask, cache, index)
        return decoder.norm(x)


def embed_text(embed_tokens: nn.Embedding, tokens: Tensor, lengths: Tensor) -> Tensor:
    """CosyVoice2's text encoding, the Qwen2 token embedding alone: tokens [B, T], lengths [B] -> [B, T, D].

    Each position is independent, so padding cannot leak into valid rows.
    """
    vocab = embed_tokens.num_embeddings
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab:
        # e.g. a special tag of the tokenizer beyond a small test vocabulary
        raise InvalidInputError(f"text token ids must be in [0, {vocab}); the text holds id {int(tokens.max())}")
    if lengths.shape != tokens.shape[:1] or (lengths.numel() and int(lengths.max()) > tokens.shape[1]):
        raise InvalidInputError("text lengths must be [B] and at most the padded text length")
    return embed_tokens(tokens.long())


class Qwen2TextEmbedding(nn.Module):
    """What an encoder-only replica keeps of a loaded `Qwen2LM`: its token embedding (a few % of the weights)."""

    def __init__(self, lm: Qwen2LM) -> None:
        super().__init__()
        self.embed_tokens = lm.llm.model.model.embed_tokens

    def encode_text(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """tokens [B, T], lengths [B] -> [B, T, D], as `Qwen2LM.encode_text`."""
        return embed_text(self.embed_tokens, tokens, lengths)


class Qwen2LM(nn.Module):
    """Module and parameter names follow the official class, so `llm.pt` loads strictly."""

    def __init__(self, cfg: Qwen2LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        classes = cfg.speech_token_size + NUM_SPECIAL_SPEECH_TOKENS
        self.llm_embedding = nn.Embedding(2, cfg.llm_input_size)
        self.llm = Qwen2Encoder(cfg.qwen)
        self.llm_decoder = Linear(cfg.llm_output_size, classes)
        self.speech_embedding = nn.Embedding(classes, cfg.llm_input_size)

    @property
    def eos(self) -> int:
        return self.cfg.speech_token_size

    @property
    def speaker_embed_dim(self) -> int | None:
        return None  # the CosyVoice2 LM has no speaker term: a request's embedding is ignored

    @property
    def fill_token(self) -> int:
        """Bi-streaming: the id that asks for more text (speech_token_size + 2)."""
        return self.cfg.speech_token_size + 2

    @property
    def end_token(self) -> int:
        """Bi-streaming: the id that ends the utterance (v2: EOS)."""
        return self.eos

    @property
    def mix_ratio(self) -> tuple[int, int]:
        return self.cfg.mix_ratio

    def bistream_prompt_split(self, prompt_text: Tensor) -> int:
        """Bi-streaming: v2 puts no prompt text before the mixed groups (all of it waits to join as text)."""
        return 0

    def encode_text(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """tokens [B, T] (right-padded ids of prompt text + text), lengths [B] -> [B, T, llm_input_size]."""
        return embed_text(self.llm.model.model.embed_tokens, tokens, lengths)

    def lm_input(self, request: GenerationRequest) -> Tensor:
        """The prefill sequence [S, llm_input_size]: sos, text embeddings, task id, prompt speech embeddings."""
        sos, task_id = self.special_embeddings()
        weight = self.speech_embedding.weight
        parts = [sos, request.text_encoded.to(weight.device), task_id]
        if request.prompt_speech_tokens is not None:
            parts.append(self.speech_embedding(request.prompt_speech_tokens.long().to(weight.device).reshape(-1)))
        return torch.cat([part.to(weight.dtype) for part in parts])

    def prompt_prefix_rows(self, request: GenerationRequest) -> int:
        """sos and the prompt text (transcript, instruction or system text): the text to speak follows them, and the
        prompt speech comes only after it, so it is no part of the prefix. 0 without prompt text."""
        prompt_text = len(request.text_encoded) - request.text_len
        return 1 + prompt_text if prompt_text else 0

    def special_embeddings(self) -> tuple[Tensor, Tensor]:
        """The sos and task-id embeddings [1, llm_input_size] each (v2: the rows of llm_embedding)."""
        weight = self.llm_embedding.weight
        return weight[SOS : SOS + 1], weight[TASK_ID : TASK_ID + 1]

    def generate(self, requests: list[GenerationRequest]) -> list[Tensor]:
        """Decode all requests as one batch -> one LongTensor [N_i] of speech tokens each, in request order."""
        return generate_tokens(self, requests)
