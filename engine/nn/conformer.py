"""The ESPnet/wenet-style relative-position encoder used three times in CosyVoice v1.

- the LLM text encoder: `ConformerEncoder`, `linear` input layer, SiLU FFN, causal (chunk-1) attention;
- the LLM backbone: `TransformerEncoder`, `linear_legacy` input layer (+ReLU), ReLU FFN, causal, decoded
  incrementally with a `KVCache`;
- the flow encoder: `ConformerEncoder`, full attention.

All use `rel_pos_espnet` positions with `rel_selfattn`, pre-norm blocks, no convolution module and no macaron
FFN. Relative-position scores depend only on the distance query - key, so `linear_pos` is applied once to a
table of distances (cached per dtype/device) and sliced per call instead of being recomputed every step.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import CheckpointError
from engine.loading.yaml_config import ObjectSpec
from engine.nn.layers import LayerNorm, Linear, length_mask, softmax_fp32

BLOCK_EPS = 1e-12  # LayerNorms inside the blocks
OUTER_EPS = 1e-5  # the input layer's LayerNorm and after_norm
_ACTIVATIONS = {"swish": F.silu, "relu": F.relu}
_INPUT_LAYERS = ("linear", "linear_legacy")
# The two official block classes differ only in what they call their two LayerNorms.
_NORM_NAMES = {"conformer": ("norm_mha", "norm_ff"), "transformer": ("norm1", "norm2")}
_BLOCK_OF_CLASS = {"ConformerEncoder": "conformer", "TransformerEncoder": "transformer"}
_MIN_TABLE_DISTANCE = 256


@dataclass(frozen=True)
class EncoderConfig:
    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    input_layer: str  # "linear" | "linear_legacy"
    activation: str  # "swish" | "relu"
    causal: bool  # static_chunk_size == 1 (without dynamic chunk): each position sees itself and the past
    block: str = "conformer"  # "conformer" | "transformer": only the LayerNorm names differ

    def __post_init__(self) -> None:
        if self.input_layer not in _INPUT_LAYERS:
            raise CheckpointError(f"encoder input_layer {self.input_layer!r} is not supported; use {_INPUT_LAYERS}")
        if self.activation not in _ACTIVATIONS:
            raise CheckpointError(f"encoder activation {self.activation!r} is not supported; use {tuple(_ACTIVATIONS)}")
        if self.block not in _NORM_NAMES:
            raise CheckpointError(f"encoder block {self.block!r} is not supported; use {tuple(_NORM_NAMES)}")
        if self.output_size % self.attention_heads:
            raise CheckpointError(
                f"encoder output_size {self.output_size} is not divisible by attention_heads {self.attention_heads}"
            )

    @classmethod
    def from_yaml(cls, spec: ObjectSpec, input_size: int | None = None) -> EncoderConfig:
        """A `ConformerEncoder` / `TransformerEncoder` node; `input_size` is used when the node lacks it."""
        name = spec.class_name if isinstance(spec, ObjectSpec) else type(spec).__name__
        if name not in _BLOCK_OF_CLASS:
            raise CheckpointError(f"encoder class {name!r} is not supported; use {tuple(_BLOCK_OF_CLASS)}")
        conformer = name == "ConformerEncoder"
        # Defaults as in the official constructors; anything but the CosyVoice v1 variant is rejected.
        required = {
            "pos_enc_layer_type": ("rel_pos", "rel_pos_espnet"),
            "selfattention_layer_type": ("rel_selfattn" if conformer else "selfattn", "rel_selfattn"),
            "normalize_before": (True, True),
            "use_dynamic_chunk": (False, False),
            "macaron_style": (conformer, False),
            "use_cnn_module": (conformer, False),
        }
        for key, (default, supported) in required.items():
            value = spec.get(key, default)
            if value != supported:
                raise CheckpointError(f"{name} with {key}={value!r} is not supported (only {supported!r})")
        chunk = spec.get("static_chunk_size", 0)
        if chunk not in (0, 1):
            raise CheckpointError(f"{name} with static_chunk_size={chunk} is not supported (only 0 or 1)")
        size = spec.get("input_size", input_size)
        if size is None:
            raise CheckpointError(f"{name} config has no input_size")
        return cls(
            input_size=int(size),
            output_size=int(spec.get("output_size", 256)),
            attention_heads=int(spec.get("attention_heads", 4)),
            linear_units=int(spec.get("linear_units", 2048)),
            num_blocks=int(spec.get("num_blocks", 6)),
            input_layer=str(spec.get("input_layer", "conv2d")),
            activation=str(spec.get("activation_type", "swish" if conformer else "relu")),
            causal=chunk == 1,
            block=_BLOCK_OF_CLASS[name],
        )


def relative_position_table(distances: Tensor, dim: int) -> Tensor:
    """ESPnet sinusoids for relative distances: [R] -> [R, dim], rows [sin(r w0), cos(r w0), sin(r w1), ...]."""
    freqs = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim))
    angles = distances.to(torch.float32)[:, None] * freqs
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)


def attention_mask(valid: Tensor, query_start: int, causal: bool) -> Tensor:
    """valid [B, Tk] (key is a real position) -> [B, Tq, Tk] bool for the queries at columns query_start..Tk-1.

    Every query may attend to itself, so no softmax row is empty (padded queries stay finite and unused).
    """
    keys = torch.arange(valid.shape[1], device=valid.device)
    queries = keys[query_start:, None]
    allowed = valid[:, None, :]
    if causal:
        allowed = allowed & (keys <= queries)
    return allowed | (keys == queries)


def _headroom(length: int) -> int:
    return length + max(64, length // 2)


def _placed(x: Tensor, dim: int, start: int, size: int) -> Tensor:
    """x inside zeros that are `size` long along `dim`, starting at column `start`."""
    out = x.new_zeros(*x.shape[:dim], size, *x.shape[dim + 1 :])
    out.narrow(dim, start, x.shape[dim]).copy_(x)
    return out


class KVCache:
    """Keys/values of every block for a batch of sequences, right-aligned: all sequences end at the last column.

    Left padding keeps relative distances exact: query and key columns differ by the same amount in every row.
    Buffers carry spare columns so that appending a step does not copy the cache.
    """

    def __init__(self, num_blocks: int, batch: int, device: torch.device | str = "cpu") -> None:
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)  # [B, capacity]: a real position
        self.keys: list[Tensor | None] = [None] * num_blocks  # [B, heads, capacity, d_k], allocated on first store
        self.values: list[Tensor | None] = [None] * num_blocks
        self.length = 0  # columns in use
        self.new = 0  # columns added by the last extend()

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    def extend(self, valid_new: Tensor) -> None:
        """Reserve the next columns; valid_new [B, T_new] tells which of them hold real positions."""
        needed = self.length + valid_new.shape[1]
        if needed > self.valid.shape[1]:
            self._regrid(None, 0, _headroom(needed))
        self.valid[:, self.length : needed] = valid_new
        self.new, self.length = valid_new.shape[1], needed

    def store(self, block: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write one block's new k/v [B, heads, T_new, d_k]; -> all its keys/values [B, heads, length, d_k]."""
        if self.keys[block] is None:
            shape = (k.shape[0], k.shape[1], self.valid.shape[1], k.shape[3])
            self.keys[block], self.values[block] = k.new_zeros(shape), v.new_zeros(shape)
        keys, values = self.keys[block], self.values[block]
        keys[:, :, self.length - self.new : self.length] = k
        values[:, :, self.length - self.new : self.length] = v
        return keys[:, :, : self.length], values[:, :, : self.length]

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (in this order), dropping the leading columns no kept row uses."""
        index = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        used = self.valid[index, : self.length].any(dim=0).nonzero()
        first = int(used[0, 0]) if len(used) else self.length
        self._regrid(index, first, _headroom(self.length - first))

    def checkpoint(self) -> KVCache:
        """The cache as it is now, for putting back after a forward pass that failed half-way: `extend` and `store`
        write only past this length (or into new buffers), so the saved view stays intact."""
        saved = copy.copy(self)
        saved.keys, saved.values = list(self.keys), list(self.values)
        return saved

    def take(self, rows: list[int]) -> KVCache:
        """A new cache holding copies of these rows (this one is left as it is)."""
        part = copy.copy(self)
        part.keys, part.values = list(self.keys), list(self.values)
        part.select(rows)  # new buffers: indexing copies
        return part

    @classmethod
    def concat(cls, caches: Sequence[KVCache]) -> KVCache:
        """The rows of all these (filled) caches in one, in order, left-padded to the longest; one copy of each row."""
        if len(caches) == 1:
            return caches[0]
        length = max(cache.length for cache in caches)
        capacity = _headroom(length)
        merged = cls(len(caches[0].keys), 0, caches[0].valid.device)

        def joined(tensors: list[Tensor], dim: int) -> Tensor:
            parts = [
                _placed(x.narrow(dim, 0, c.length), dim, length - c.length, capacity)
                for x, c in zip(tensors, caches, strict=True)
            ]
            return torch.cat(parts, dim=0)

        merged.valid = joined([c.valid for c in caches], 1)
        merged.keys = [joined(list(blocks), 2) for blocks in zip(*(c.keys for c in caches), strict=True)]
        merged.values = [joined(list(blocks), 2) for blocks in zip(*(c.values for c in caches), strict=True)]
        merged.length = length
        return merged

    @property
    def shares_buffers(self) -> bool:
        """Whether this cache is one row of a larger batch's buffers (`split`), which it keeps alive."""
        return self.valid.untyped_storage().nbytes() > self.valid.nbytes

    def split(self) -> list[KVCache]:
        """One cache per row, each a view of this one's buffers without the leading columns its row does not use (no
        copy: the rows' next columns are written into this cache's spare ones, which nothing else reads)."""
        parts = []
        for row in range(self.batch):
            used = self.valid[row, : self.length].nonzero()
            first = int(used[0, 0]) if len(used) else self.length
            part = copy.copy(self)
            part.valid = self.valid[row : row + 1, first:]
            part.keys = [None if k is None else k[row : row + 1, :, first:] for k in self.keys]
            part.values = [None if v is None else v[row : row + 1, :, first:] for v in self.values]
            part.length = self.length - first
            parts.append(part)
        return parts

    def _regrid(self, rows: Tensor | None, first: int, capacity: int) -> None:
        """New buffers of `capacity` columns holding `rows` (all when None) and the columns first..length-1."""

        def moved(x: Tensor | None, dim: int) -> Tensor | None:
            if x is None:
                return None
            kept = (x if rows is None else x[rows]).narrow(dim, first, self.length - first)
            return _placed(kept, dim, 0, capacity)

        self.valid = moved(self.valid, 1)
        self.keys = [moved(k, 2) for k in self.keys]
        self.values = [moved(v, 2) for v in self.values]
        self.length -= first


class RelPositionAttention(nn.Module):
    """ESPnet rel_selfattn: scores = ((q + u) k^T + shift((q + v) p^T)) / sqrt(d_k), p = linear_pos(positions)."""

    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.head_dim, self.causal = heads, dim // heads, causal
        self.linear_q = Linear(dim, dim)
        self.linear_k = Linear(dim, dim)
        self.linear_v = Linear(dim, dim)
        self.linear_out = Linear(dim, dim)
        self.linear_pos = Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.head_dim))
        self._positions: tuple[tuple, int, Tensor] | None = None
        self.register_load_state_dict_post_hook(lambda module, _: setattr(module, "_positions", None))

    def _split_heads(self, x: Tensor) -> Tensor:
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def projected_positions(self, max_distance: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, int]:
        """-> (linear_pos of the distance table as [heads, rows, d_k], center): row center - r is distance r.

        Rows run from the largest distance down (to 0 when causal, else to -center). The table is computed once
        and grown by doubling; it is a constant for inference, so it is built outside autograd and inference mode.
        """
        key = (dtype, device, self.linear_pos)
        if self._positions is None or self._positions[0] != key or self._positions[1] < max_distance:
            reach = max(_MIN_TABLE_DISTANCE, max_distance, 2 * self._positions[1] if self._positions else 0)
            low = 0 if self.causal else -reach
            with torch.inference_mode(False), torch.no_grad():
                distances = torch.arange(reach, low - 1, -1, device=device)
                table = relative_position_table(distances, self.heads * self.head_dim).to(device=device, dtype=dtype)
                projected = self.linear_pos(table).view(-1, self.heads, self.head_dim).transpose(0, 1).contiguous()
            self._positions = (key, reach, projected)
        return self._positions[2], self._positions[1]

    def forward(self, x: Tensor, mask: Tensor, cache: KVCache | None = None, block: int = 0) -> Tensor:
        """x [B, Tq, D], mask [B, Tq, Tk] -> [B, Tq, D]; with a cache the Tq new keys join its Tk - Tq old ones."""
        q, k, v = (self._split_heads(layer(x)) for layer in (self.linear_q, self.linear_k, self.linear_v))
        if cache is not None:
            k, v = cache.store(block, k, v)
        queries, keys = q.shape[2], k.shape[2]
        scale = 1.0 / math.sqrt(self.head_dim)  # applied to q: keeps fp16 scores in range
        q_u = (q + self.pos_bias_u[:, None].to(q.dtype)) * scale
        q_v = (q + self.pos_bias_v[:, None].to(q.dtype)) * scale
        # Query t sits at column keys - queries + t; distances to keys 0..keys-1 span keys-1 down to 1-queries.
        max_distance, min_distance = keys - 1, (0 if self.causal else 1 - queries)
        table, center = self.projected_positions(max(max_distance, -min_distance), q.dtype, q.device)
        positions = table[:, center - max_distance : center - min_distance + 1]  # distances max..min
        # The table is shared by the whole batch: one [h, B*Tq, d_k] x [h, d_k, R] product reads it once, where
        # broadcasting it over B would first copy it B times (at batch 8 that copy was a fifth of a decode step).
        batch, heads = q.shape[:2]
        per_head = q_v.transpose(0, 1).reshape(heads, batch * queries, self.head_dim)
        position_scores = torch.bmm(per_head, positions.transpose(-1, -2)).view(heads, batch, queries, -1)
        position_scores = position_scores.transpose(0, 1)  # [B, h, Tq, R]
        if queries > 1:  # one query (a decode step) reads its distances keys-1..0 in column order already
            columns = torch.arange(keys, device=x.device)
            query_columns = columns[keys - queries :, None]
            offset = max_distance - (query_columns - columns).clamp(min=min_distance)
            position_scores = position_scores.gather(-1, offset.expand(*position_scores.shape[:2], -1, -1))
        scores = torch.matmul(q_u, k.transpose(-1, -2)) + position_scores
        weights = softmax_fp32(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1)
        out = torch.matmul(weights.to(v.dtype), v).transpose(1, 2).flatten(2)
        return self.linear_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, activation: str) -> None:
        super().__init__()
        self.w_1 = Linear(dim, hidden)
        self.w_2 = Linear(hidden, dim)
        self.activation = _ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        """x [B, T, D] -> [B, T, D]."""
        return self.w_2(self.activation(self.w_1(x)))


class EncoderBlock(nn.Module):
    """Pre-norm block: x + MHA(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        dim = cfg.output_size
        self.self_attn = RelPositionAttention(dim, cfg.attention_heads, cfg.causal)
        self.feed_forward = FeedForward(dim, cfg.linear_units, cfg.activation)
        self.norm_names = _NORM_NAMES[cfg.block]
        for name in self.norm_names:
            self.add_module(name, LayerNorm(dim, eps=BLOCK_EPS))

    def forward(self, x: Tensor, mask: Tensor, cache: KVCache | None = None, block: int = 0) -> Tensor:
        """x [B, Tq, D], mask [B, Tq, Tk] -> [B, Tq, D]."""
        attention_norm, ff_norm = (self._modules[name] for name in self.norm_names)
        x = x + self.self_attn(attention_norm(x), mask, cache, block)
        return x + self.feed_forward(ff_norm(x))


class InputLayer(nn.Module):
    """`linear`: Linear -> LayerNorm; `linear_legacy` adds a ReLU; then x * sqrt(d) (positions go to attention)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.out = nn.Sequential(Linear(cfg.input_size, cfg.output_size), LayerNorm(cfg.output_size, eps=OUTER_EPS))
        self.relu = cfg.input_layer == "linear_legacy"
        self.scale = math.sqrt(cfg.output_size)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, T, input_size] -> [B, T, output_size]."""
        x = self.out(x)
        return (F.relu(x) if self.relu else x) * self.scale


class RelPositionEncoder(nn.Module):
    """The official `ConformerEncoder` / `TransformerEncoder` (see the module docstring); inference only."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = InputLayer(cfg)
        self.encoders = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_blocks))
        self.after_norm = LayerNorm(cfg.output_size, eps=OUTER_EPS)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        """x [B, T, input_size] (right-padded), lengths [B] -> [B, T, output_size].

        Padded positions never influence valid ones; their own outputs are unspecified (finite).
        """
        valid = length_mask(lengths.to(x.device), x.shape[1])
        mask = attention_mask(valid, 0, self.cfg.causal)
        x = self.embed(x)
        for block in self.encoders:
            x = block(x, mask)
        return self.after_norm(x)

    def new_cache(self, batch: int, device: torch.device | str = "cpu") -> KVCache:
        return KVCache(len(self.encoders), batch, device)

    def forward_incremental(self, x: Tensor, valid: Tensor, cache: KVCache) -> Tensor:
        """The next positions of every sequence in `cache`: x [B, T_new, input_size], valid [B, T_new] bool
        (False = left padding) -> [B, T_new, output_size]; their keys/values are appended to `cache`.

        A prefill is a call on an empty cache (left-pad the inputs); a decode step is a call with T_new = 1.
        """
        if not self.cfg.causal:
            raise ValueError("incremental decoding needs a causal encoder")
        cache.extend(valid.to(cache.valid.device))
        mask = attention_mask(cache.valid[:, : cache.length], cache.length - x.shape[1], causal=True)
        x = self.embed(x)
        for index, block in enumerate(self.encoders):
            x = block(x, mask, cache, index)
        return self.after_norm(x)
