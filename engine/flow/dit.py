"""The CosyVoice3 flow (`CausalMaskedDiffWithDiT`): speech tokens -> 80-bin mel with a DiT velocity field, batched.

No token encoder: tokens are embedded straight to 80 channels, mixed with the next 3 by the pre-lookahead
convolution and repeated x2 to mel frames (mu). The ODE, its start noise and classifier-free guidance are v2's
(`engine.flow.causal.CausalConditionalCFM`); the velocity field is an F5-TTS-style diffusion transformer (`DiT`:
AdaLayerNormZero blocks with rotary self-attention, where only head 0's channels rotate, as in the official model).

Precision: LayerNorms, the attention's scores, softmax and sums, the residual stream and the ODE state stay in fp32;
a non-finite mel at reduced precision is computed again in fp32. Batching: requests are right-padded, keys masked,
and the pre-lookahead's inputs zeroed past each request, so a request's mel does not depend on what it is batched
with. The layer by layer description: docs/models.md, "CosyVoice3's DiT flow".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import InvalidInputError
from engine.flow.causal import (
    CausalConditionalCFM,
    PreLookaheadLayer,
    check_causal_flow_request,
    chunk_attention_mask,
)
from engine.flow.estimator import sinusoidal_time_embedding
from engine.flow.masked_diff import (
    CFG_ROWS,
    FlowRequest,
    cfm_inference_cfg_rate,
    embed_flow_tokens,
    prompt_condition,
    speaker_vectors,
    target_frames,
)
from engine.loading.yaml_config import expect_class, require
from engine.nn.layers import CausalConv1d, LayerNorm, Linear, compute_dtype, length_mask
from engine.nn.precision import recompute_non_finite

TIME_FREQUENCY_DIM = 256  # the official TimestepEmbedding's sinusoid width (not in the yaml)
POSITION_KERNEL, POSITION_GROUPS = 31, 16  # the official CausalConvPositionEmbedding's constants
NORM_EPS = 1e-6
ROTARY_BASE = 10000.0


@dataclass(frozen=True)
class DiTConfig:
    dim: int
    depth: int
    heads: int
    dim_head: int
    ff_mult: float
    mel_dim: int  # x (the ODE state) and the output
    mu_dim: int
    spk_dim: int
    static_chunk_size: int  # mel frames per attention chunk when streaming

    @classmethod
    def from_yaml(cls, spec: object) -> DiTConfig:
        """From the yaml `estimator` node (class `DiT`)."""
        spec = expect_class(spec, "DiT", "flow estimator")
        require(not spec.get("long_skip_connection", False), "DiT long_skip_connection is not supported")
        left_chunks = spec.get("num_decoding_left_chunks", 2)
        require(left_chunks < 0, f"DiT num_decoding_left_chunks={left_chunks} is not supported (only all, -1)")
        mel_dim = int(spec.get("mel_dim", 80))
        config = cls(
            dim=int(spec["dim"]),
            depth=int(spec.get("depth", 8)),
            heads=int(spec.get("heads", 8)),
            dim_head=int(spec.get("dim_head", 64)),
            ff_mult=float(spec.get("ff_mult", 4)),
            mel_dim=mel_dim,
            mu_dim=int(spec.get("mu_dim") or mel_dim),
            spk_dim=int(spec.get("spk_dim") or 0),
            static_chunk_size=int(spec.get("static_chunk_size", 50)),
        )
        out_channels = spec.get("out_channels")
        require(out_channels in (None, mel_dim), f"DiT out_channels {out_channels} must equal mel_dim {mel_dim}")
        require(config.spk_dim > 0, "a DiT without a speaker input (spk_dim) is not supported")
        require(config.dim % POSITION_GROUPS == 0, f"DiT dim must be a multiple of {POSITION_GROUPS}")
        require(config.dim_head % 2 == 0, "DiT dim_head must be even for the rotary embedding")
        require(config.static_chunk_size > 0, "DiT static_chunk_size must be positive")
        return config


@dataclass(frozen=True)
class DiTFlowConfig:
    input_size: int  # token embedding width (= mu channels)
    output_size: int  # mel bins
    spk_embed_dim: int
    vocab_size: int
    token_mel_ratio: int
    pre_lookahead_len: int
    lookahead_channels: int  # the pre-lookahead layer's hidden width
    inference_cfg_rate: float
    estimator: DiTConfig

    @classmethod
    def from_yaml(cls, spec: object) -> DiTFlowConfig:
        """From the yaml `flow` node (class `CausalMaskedDiffWithDiT`)."""
        spec = expect_class(spec, "CausalMaskedDiffWithDiT", "flow")
        output_type = spec.get("output_type", "mel")
        require(output_type == "mel", f"unsupported flow output_type {output_type!r}; only 'mel' is implemented")
        lookahead = expect_class(spec.get("pre_lookahead_layer"), "PreLookaheadLayer", "flow pre_lookahead_layer")
        decoder = spec["decoder"]
        config = cls(
            input_size=int(spec.get("input_size", 512)),
            output_size=int(spec.get("output_size", 80)),
            spk_embed_dim=int(spec.get("spk_embed_dim", 192)),
            vocab_size=int(spec["vocab_size"]),
            token_mel_ratio=int(spec.get("token_mel_ratio", 2)),
            pre_lookahead_len=int(spec.get("pre_lookahead_len", 3)),
            lookahead_channels=int(lookahead["channels"]),
            inference_cfg_rate=cfm_inference_cfg_rate(decoder, "CausalConditionalCFM"),
            estimator=DiTConfig.from_yaml(decoder["estimator"]),
        )
        require(
            int(lookahead.get("in_channels", config.input_size)) == config.input_size
            and int(lookahead.get("pre_lookahead_len", 1)) == config.pre_lookahead_len,
            "the pre_lookahead_layer must take input_size channels and read pre_lookahead_len tokens ahead",
        )
        estimator, mel = config.estimator, config.output_size
        require(estimator.mel_dim == mel, f"DiT mel_dim {estimator.mel_dim} must equal the flow output_size {mel}")
        require(estimator.mu_dim == config.input_size, "DiT mu_dim must equal the flow input_size")
        require(estimator.spk_dim == mel, "DiT spk_dim must equal output_size (the projected speaker vector)")
        return config

    def mel_frames_of(self, speech_tokens: int) -> int:
        """Mel frames the flow makes from `speech_tokens` tokens."""
        return speech_tokens * self.token_mel_ratio

    def activation_bytes(self, frames: int, dtype_bytes: int) -> int:
        """Peak bytes of the DiT's activations over `frames` mel frames, for the CFG pair: per frame its stacked
        input, one block's q, k, v, attention output and feed-forward hidden layer, and the residual stream (kept
        in fp32); per pair of frames the attention mask, and the fp32 scores where a kernel materialises them."""
        dit = self.estimator
        inner = dit.heads * dit.dim_head
        stacked_input = 2 * dit.mel_dim + dit.mu_dim + dit.spk_dim
        per_frame = (stacked_input + 4 * inner + int(dit.ff_mult * dit.dim)) * dtype_bytes + 2 * dit.dim * 4
        per_frame_pair = dit.heads * 4 + 1
        return CFG_ROWS * (frames * per_frame + frames * frames * per_frame_pair)


class TimestepEmbedding(nn.Module):
    """t in [0, 1] -> sinusoids (scale 1000, 256 wide) -> Linear -> SiLU -> Linear."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(Linear(TIME_FREQUENCY_DIM, dim), nn.SiLU(), Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        """t [B] -> [B, dim]."""
        return self.time_mlp(sinusoidal_time_embedding(t, TIME_FREQUENCY_DIM))


class InputEmbedding(nn.Module):
    """concat(x, cond, mu, speaker) -> Linear, plus a causal two-layer grouped-conv (Mish) position embedding."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.proj = Linear(2 * config.mel_dim + config.mu_dim + config.spk_dim, config.dim)
        self.conv_pos_embed = nn.Module()
        for name in ("conv1", "conv2"):
            conv = CausalConv1d(config.dim, config.dim, POSITION_KERNEL, groups=POSITION_GROUPS)
            self.conv_pos_embed.add_module(name, nn.Sequential(conv, nn.Mish()))

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor) -> Tensor:
        """x, cond: [B, T, mel], mu: [B, T, mu_dim], spks: [B, spk_dim] -> [B, T, dim]."""
        speaker = spks[:, None].expand(-1, x.shape[1], -1)
        h = self.proj(torch.cat([x, cond, mu, speaker.to(x.dtype)], dim=-1))
        position = self.conv_pos_embed.conv2(self.conv_pos_embed.conv1(h.transpose(1, 2)))
        return position.transpose(1, 2) + h


class RotaryEmbedding(nn.Module):
    """x_transformers' RotaryEmbedding: `inv_freq` is in the checkpoint; pairs (2i, 2i+1) share a frequency."""

    def __init__(self, dim_head: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / ROTARY_BASE ** (torch.arange(0, dim_head, 2).float() / dim_head))

    def forward(self, frames: int) -> tuple[Tensor, Tensor]:
        """-> (cos, sin) [frames, dim_head] fp32, each frequency repeated for its pair."""
        positions = torch.arange(frames, device=self.inv_freq.device, dtype=torch.float32)
        angles = (positions[:, None] * self.inv_freq.float()[None]).repeat_interleave(2, dim=-1)
        return angles.cos(), angles.sin()


def rotate_leading_channels(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, C]: its first cos.shape[-1] channels rotated pairwise ((a, b) -> a cos - b sin, b cos + a sin)."""
    width = cos.shape[-1]
    rotated, rest = x[..., :width].float(), x[..., width:]
    first, second = rotated[..., 0::2], rotated[..., 1::2]
    turned = torch.stack([-second, first], dim=-1).flatten(-2)
    return torch.cat([(rotated * cos + turned * sin).to(x.dtype), rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.heads, self.dim_head = config.heads, config.dim_head
        inner = config.heads * config.dim_head
        self.to_q = Linear(config.dim, inner)
        self.to_k = Linear(config.dim, inner)
        self.to_v = Linear(config.dim, inner)
        self.to_out = nn.ModuleList([Linear(inner, config.dim), nn.Identity()])  # [1] is the official dropout

    def forward(self, x: Tensor, allowed: Tensor, rotary: tuple[Tensor, Tensor]) -> Tensor:
        """x [B, T, dim], allowed [B, T, T] bool (query i may read key j), rotary cos/sin [T, dim_head]
        -> [B, T, dim]."""
        batch, frames, _ = x.shape
        q = rotate_leading_channels(self.to_q(x), *rotary)
        k = rotate_leading_channels(self.to_k(x), *rotary)
        q, k, v = (h.view(batch, frames, self.heads, self.dim_head).transpose(1, 2) for h in (q, k, self.to_v(x)))
        # scores, softmax and sums accumulate in fp32 inside the kernel whatever q/k/v's dtype; no [T, T] scores
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None]).transpose(1, 2).flatten(2)
        return self.to_out[0](out)


class AdaLayerNorm(nn.Module):
    """LayerNorm without affine whose shifts, scales (and gates) come from the time embedding via SiLU -> Linear."""

    def __init__(self, dim: int, modulations: int) -> None:
        super().__init__()
        self.linear = Linear(dim, modulations * dim)
        self.norm = LayerNorm(dim, elementwise_affine=False, eps=NORM_EPS)
        self.modulations = modulations

    def forward(self, time: Tensor) -> list[Tensor]:
        """time [B, dim] -> `modulations` tensors [B, 1, dim] in the official chunk order."""
        return [m[:, None] for m in self.linear(F.silu(time)).chunk(self.modulations, dim=-1)]


class DiTBlock(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        dim, inner = config.dim, int(config.dim * config.ff_mult)
        self.attn_norm = AdaLayerNorm(dim, 6)
        self.attn = Attention(config)
        self.ff_norm = LayerNorm(dim, elementwise_affine=False, eps=NORM_EPS)
        # keys ff.ff.0.0 and ff.ff.2 as the official FeedForward (index 1 is its dropout)
        self.ff = nn.Module()
        self.ff.ff = nn.Sequential(
            nn.Sequential(Linear(dim, inner), nn.GELU(approximate="tanh")), nn.Identity(), Linear(inner, dim)
        )

    def forward(self, x: Tensor, time: Tensor, allowed: Tensor, rotary: tuple[Tensor, Tensor]) -> Tensor:
        """x [B, T, dim], time [B, dim] -> [B, T, dim]."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(time)
        normed = self.attn_norm.norm(x) * (1 + scale_msa) + shift_msa
        x = x + gate_msa * self.attn(normed, allowed, rotary)
        normed = self.ff_norm(x) * (1 + scale_mlp) + shift_mlp
        return x + gate_mlp * self.ff.ff(normed)


class DiT(nn.Module):
    """The velocity field: (x, mask, mu, t, spks, cond) -> dx/dt, the signature `CausalConditionalCFM` calls."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.config = config
        self.time_embed = TimestepEmbedding(config.dim)
        self.input_embed = InputEmbedding(config)
        self.rotary_embed = RotaryEmbedding(config.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.depth))
        self.norm_out = AdaLayerNorm(config.dim, 2)
        self.proj_out = Linear(config.dim, config.mel_dim)

    def forward(
        self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, streaming: bool = False
    ) -> Tensor:
        """x, cond: [B, mel, T], mask: [B, 1, T] (1 on valid frames), mu: [B, mu_dim, T], t: [B], spks: [B, spk_dim]
        -> [B, mel, T]. With `streaming` each frame attends only to its own and earlier static chunks."""
        dtype = compute_dtype(self.proj_out.weight.dtype)
        time = self.time_embed(t)
        h = self.input_embed(*(v.transpose(1, 2).to(dtype) for v in (x, cond, mu)), spks.to(dtype))
        h = h.float()  # the residual stream: each block adds its reduced-precision output to it in fp32
        allowed = chunk_attention_mask(mask[:, 0] > 0, self.config.static_chunk_size if streaming else 0)
        rotary = self.rotary_embed(h.shape[1])
        for block in self.transformer_blocks:
            h = block(h, time, allowed, rotary)
        scale, shift = self.norm_out(time)
        return self.proj_out(self.norm_out.norm(h) * (1 + scale) + shift).transpose(1, 2)


@dataclass
class DiTFlowConditioning:
    """Everything the CFM is conditioned on, for a padded batch (mel frames include the prompt frames)."""

    lookahead_out: Tensor  # [B, T_tok, input_size] pre-lookahead output, padded past each request's tokens
    mu: Tensor  # [B, input_size, T_mel] lookahead_out repeated token_mel_ratio times
    spks: Tensor  # [B, mel] projected speaker embedding
    cond: Tensor  # [B, mel, T_mel] prompt mel in the first prompt frames, zeros after
    mask: Tensor  # [B, 1, T_mel] 1 on valid frames
    prompt_frames: list[int]  # official mel_len1 per request
    mel_lengths: list[int]  # mel_len1 + mel_len2 per request


class CausalMaskedDiffWithDiT(nn.Module):
    def __init__(self, config: DiTFlowConfig) -> None:
        super().__init__()
        self.config = config
        mel = config.output_size
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = Linear(config.spk_embed_dim, mel)
        self.pre_lookahead_layer = PreLookaheadLayer(
            config.input_size, config.pre_lookahead_len, hidden=config.lookahead_channels
        )
        self.decoder = CausalConditionalCFM(config.inference_cfg_rate, mel, DiT(config.estimator))

    @torch.inference_mode()
    def prepare(self, requests: list[FlowRequest], finalize: bool = True) -> DiTFlowConditioning:
        """The CFM conditioning of a batch (see DiTFlowConditioning).

        With finalize=False the last `pre_lookahead_len` tokens of each request are look-ahead context only.
        """
        if not requests:
            raise InvalidInputError("the flow needs at least one request")
        config = self.config
        context = 0 if finalize else config.pre_lookahead_len
        for index, request in enumerate(requests):
            check_causal_flow_request(config, index, request, context)
        embedded, token_lengths, readable = embed_flow_tokens(self.input_embedding, requests)
        lookahead_out = self.pre_lookahead_layer(embedded, readable)[:, : embedded.shape[1] - context]
        mu = lookahead_out.repeat_interleave(config.token_mel_ratio, dim=1).transpose(1, 2)
        mel_lengths = (token_lengths - context) * config.token_mel_ratio
        mask = length_mask(mel_lengths, mu.shape[2]).unsqueeze(1).to(mu.dtype)
        spks = speaker_vectors(self.spk_embed_affine_layer, requests)
        cond = prompt_condition(requests, mu, config.output_size)
        prompt_frames = [r.prompt_feat.shape[0] for r in requests]
        return DiTFlowConditioning(lookahead_out, mu, spks, cond, mask, prompt_frames, mel_lengths.tolist())

    @torch.inference_mode()
    def inference(
        self, requests: list[FlowRequest], n_timesteps: int = 10, streaming: bool = False, finalize: bool = True
    ) -> list[Tensor]:
        """Mel of each request's target tokens (prompt frames removed): fp32 [80, mel_len2] per request.

        mel_len2 = token_mel_ratio * (prompt + target tokens, less the last pre_lookahead_len when finalize is
        False) - prompt frames. `streaming` limits the DiT attention to static chunks, as the official streaming
        calls do. The ODE starts from the fixed noise, so the requests' `noise` and `seed` are ignored. A mel that
        is not finite at reduced precision is computed again in fp32 (see engine.nn.precision.recompute_non_finite).
        """
        if not requests:
            return []
        conditioning = self.prepare(requests, finalize)
        feat = self.decoder(
            conditioning.mu, conditioning.mask, conditioning.spks, conditioning.cond, n_timesteps, streaming
        )
        mels = target_frames(feat, conditioning.prompt_frames, conditioning.mel_lengths)
        return recompute_non_finite(
            "flow",
            mels,
            self.input_embedding.weight.dtype,
            lambda index: self.inference([requests[index]], n_timesteps, streaming, finalize)[0],
        )
