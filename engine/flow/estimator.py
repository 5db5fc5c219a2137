"""The CFM velocity estimator of CosyVoice v1: Matcha-TTS's 1-D U-Net (`ConditionalDecoder`).

ResNet1D blocks and diffusers-style transformer blocks at each resolution, downsampled by 2 per level,
with skip connections. Everything is masked so that a request inside a padded batch sees exactly what it
would see alone: convolutions read zeros past its length, group norms average over its frames only, and
attention ignores padded keys. A batch without padding (every batch of one) passes `None` for the masks
and skips all of that work. Module names reproduce the official `decoder.estimator.*` keys.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import CheckpointError
from engine.loading.yaml_config import ObjectSpec, expect_class
from engine.nn.layers import Conv1d, ConvTranspose1d, GroupNorm, LayerNorm, Linear, apply_mask

_TIME_SCALE = 1000.0  # Matcha's SinusoidalPosEmb multiplies t in [0, 1] by this
_RESNET_GROUPS = 8
_MASK_BIAS = -1.0e10  # the official additive bias of padded keys


@dataclass(frozen=True)
class EstimatorConfig:
    in_channels: int  # x, mu, spks and cond stacked: 4 x 80
    out_channels: int
    channels: tuple[int, ...]  # one U-Net level per entry
    attention_head_dim: int
    n_blocks: int  # transformer blocks per level
    num_mid_blocks: int
    num_heads: int

    @classmethod
    def from_yaml(cls, spec: ObjectSpec) -> EstimatorConfig:
        """From the yaml `estimator` node (class `ConditionalDecoder`)."""
        expect_class(spec, "ConditionalDecoder", "flow estimator")
        act_fn = spec.get("act_fn", "snake")
        if act_fn != "gelu":
            raise CheckpointError(f"unsupported estimator act_fn {act_fn!r}; only 'gelu' is implemented")
        return cls(
            in_channels=int(spec["in_channels"]),
            out_channels=int(spec["out_channels"]),
            channels=tuple(int(c) for c in spec.get("channels", (256, 256))),
            attention_head_dim=int(spec.get("attention_head_dim", 64)),
            n_blocks=int(spec.get("n_blocks", 1)),
            num_mid_blocks=int(spec.get("num_mid_blocks", 2)),
            num_heads=int(spec.get("num_heads", 4)),
        )


class MaskedGroupNorm(GroupNorm):
    """GroupNorm whose statistics cover only the valid frames, so padding does not leak into them."""

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """x: [B, C, T], mask: [B, 1, T] (1 = valid) or None (all valid) -> [B, C, T], computed in fp32."""
        if mask is None:
            return super().forward(x)  # one fused pass instead of the weighted sums below
        batch, channels, frames = x.shape
        grouped = x.float().reshape(batch, self.num_groups, -1, frames)
        weights = mask.float().reshape(batch, 1, 1, frames)
        count = weights.sum(dim=(2, 3), keepdim=True) * grouped.shape[2]
        mean = (grouped * weights).sum(dim=(2, 3), keepdim=True) / count
        centred = grouped - mean
        variance = (centred.square() * weights).sum(dim=(2, 3), keepdim=True) / count
        normed = (centred * torch.rsqrt(variance + self.eps)).reshape(batch, channels, frames)
        return (normed * self.weight.float()[:, None] + self.bias.float()[:, None]).type(x.dtype)


class Block1D(nn.Module):
    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Conv1d(dim, dim_out, 3, padding=1), MaskedGroupNorm(_RESNET_GROUPS, dim_out), nn.Mish()
        )

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """x: [B, dim, T], mask: [B, 1, T] or None -> [B, dim_out, T], zero on padded frames."""
        conv, norm, act = self.block
        return apply_mask(act(norm(conv(apply_mask(x, mask)), mask)), mask)


class ResnetBlock1D(nn.Module):
    block_class: type[nn.Module] = Block1D  # (dim, dim_out) -> forward(x, mask); the causal flow's is causal

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), Linear(time_emb_dim, dim_out))
        self.block1 = self.block_class(dim, dim_out)
        self.block2 = self.block_class(dim_out, dim_out)
        self.res_conv = Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor | None, time_emb: Tensor) -> Tensor:
        """x: [B, dim, T], mask: [B, 1, T] or None, time_emb: [B, time_emb_dim] -> [B, dim_out, T]."""
        h = self.block1(x, mask) + self.mlp(time_emb).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(apply_mask(x, mask))


class Attention(nn.Module):
    """diffusers `Attention` self-attention: bias-free q/k/v, heads x head_dim independent of the width."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        inner = num_heads * head_dim
        self.to_q = Linear(dim, inner, bias=False)
        self.to_k = Linear(dim, inner, bias=False)
        self.to_v = Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([Linear(inner, dim)])  # diffusers keeps a dropout at index 1

    def forward(self, x: Tensor, key_bias: Tensor | None) -> Tensor:
        """x: [B, T, dim], key_bias: [B, 1, 1, T] fp32 additive bias or None (no padding) -> [B, T, dim]."""
        batch, frames, _ = x.shape
        q, k, v = (
            projection(x).view(batch, frames, self.num_heads, self.head_dim).transpose(1, 2)
            for projection in (self.to_q, self.to_k, self.to_v)
        )
        # The fused CPU kernel reads the strided heads in place and accumulates scores and softmax in fp32
        # (finite and at least as accurate as an fp32 softmax over fp16 scores); its output is laid out
        # [B, T, heads, head_dim], so merging the heads back is a view.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_bias)
        return self.to_out[0](out.transpose(1, 2).reshape(batch, frames, -1))


class GELUProjection(nn.Module):
    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = Linear(dim_in, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        # index 1 is the dropout slot of the official layout; keeping it keeps the `net.2` key
        self.net = nn.Sequential(GELUProjection(dim, dim * mult), nn.Identity(), Linear(dim * mult, dim))

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, T, dim] -> [B, T, dim]."""
        return self.net(x)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + GELU feed-forward (Matcha's BasicTransformerBlock, layer_norm variant)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = LayerNorm(dim)
        self.attn1 = Attention(dim, num_heads, head_dim)
        self.norm3 = LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: Tensor, key_bias: Tensor | None) -> Tensor:
        """x: [B, T, dim], key_bias: [B, 1, 1, T] or None -> [B, T, dim]."""
        x = x + self.attn1(self.norm1(x), key_bias)
        return x + self.ff(self.norm3(x))


class Downsample1D(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = Conv1d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, T] -> [B, C, ceil(T / 2)]."""
        return self.conv(x)


class Upsample1D(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = ConvTranspose1d(channels, channels, 4, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, T] -> [B, C, 2 T]."""
        return self.conv(x)


class TimestepEmbedding(nn.Module):
    def __init__(self, in_channels: int, time_embed_dim: int) -> None:
        super().__init__()
        self.linear_1 = Linear(in_channels, time_embed_dim)
        self.act = nn.SiLU()
        self.linear_2 = Linear(time_embed_dim, time_embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def sinusoidal_time_embedding(t: Tensor, dim: int) -> Tensor:
    """t: [B] in [0, 1] -> [B, dim] fp32, [sin | cos] halves with frequencies exp(-i ln(10000) / (half - 1))."""
    half = dim // 2
    frequencies = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angles = _TIME_SCALE * t.float().unsqueeze(1) * frequencies.unsqueeze(0)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class UNetLevel(nn.ModuleList):
    """One U-Net stage, laid out as the official triple: [ResNet block, transformer blocks, resampling layer]."""

    def __init__(self, config: EstimatorConfig, dim: int, dim_out: int, resample: nn.Module | None) -> None:
        blocks = [
            TransformerBlock(dim_out, config.num_heads, config.attention_head_dim) for _ in range(config.n_blocks)
        ]
        stage = [ResnetBlock1D(dim, dim_out, _time_embed_dim(config)), nn.ModuleList(blocks)]
        super().__init__(stage if resample is None else [*stage, resample])

    def forward(self, x: Tensor, mask: Tensor | None, attention: Tensor | None, time_emb: Tensor) -> Tensor:
        """x: [B, dim, T], mask: [B, 1, T] or None (no padding), attention: what the transformer blocks take, here a
        key bias [B, 1, 1, T] or None (no padding) -> [B, dim_out, T] (before resampling)."""
        resnet, blocks = self[0], self[1]
        # one copy into the [B, T, C] layout here, rather than one inside every norm and projection below
        x = resnet(x, mask, time_emb).transpose(1, 2).contiguous()
        for block in blocks:
            x = block(x, attention)
        return x.transpose(1, 2)

    def resample(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """x: [B, dim_out, T] -> the next resolution (padded frames zeroed first, as zero padding and as the official
        code does)."""
        return self[2](apply_mask(x, mask))


def _time_embed_dim(config: EstimatorConfig) -> int:
    return config.channels[0] * 4


class ConditionalDecoder(nn.Module):
    def __init__(self, config: EstimatorConfig) -> None:
        super().__init__()
        self.config = config
        channels = config.channels
        self.time_mlp = TimestepEmbedding(config.in_channels, _time_embed_dim(config))

        down_widths = [config.in_channels, *channels]
        self.down_blocks = nn.ModuleList()
        for level, (dim, dim_out) in enumerate(itertools.pairwise(down_widths)):
            is_last = level == len(channels) - 1
            resample = Conv1d(dim_out, dim_out, 3, padding=1) if is_last else Downsample1D(dim_out)
            self.down_blocks.append(UNetLevel(config, dim, dim_out, resample))

        self.mid_blocks = nn.ModuleList(
            UNetLevel(config, channels[-1], channels[-1], None) for _ in range(config.num_mid_blocks)
        )

        up_widths = [*channels[::-1], channels[0]]
        self.up_blocks = nn.ModuleList()
        for level, (dim, dim_out) in enumerate(itertools.pairwise(up_widths)):
            is_last = level == len(channels) - 1
            resample = Conv1d(dim_out, dim_out, 3, padding=1) if is_last else Upsample1D(dim_out)
            self.up_blocks.append(UNetLevel(config, 2 * dim, dim_out, resample))  # 2x: the skip is stacked on

        self.final_block = Block1D(channels[0], channels[0])
        self.final_proj = Conv1d(channels[0], config.out_channels, 1)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        """Velocity of the flow at time t.

        x, mu, cond: [B, 80, T]; mask: [B, 1, T] (1 = valid frame); t: [B]; spks: [B, 80] -> [B, out_channels, T].
        """
        time_emb = self.time_mlp(sinusoidal_time_embedding(t, self.config.in_channels))
        x = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1)

        # per-resolution masks and attention biases, built once and shared by all blocks of a level
        levels = len(self.config.channels)
        masks: list[Tensor | None] = [None] * levels
        key_biases: list[Tensor | None] = [None] * levels
        if not bool(mask.all()):
            padded = [mask]
            for _ in range(1, levels):
                padded.append(padded[-1][:, :, ::2])
            masks = list(padded)
            key_biases = [((1.0 - m.float()) * _MASK_BIAS).unsqueeze(1) for m in padded]

        skips = []
        for level, down in enumerate(self.down_blocks):
            x = down(x, masks[level], key_biases[level], time_emb)
            skips.append(x)
            x = down.resample(x, masks[level])

        for mid in self.mid_blocks:
            x = mid(x, masks[-1], key_biases[-1], time_emb)

        for level, up in zip(reversed(range(len(masks))), self.up_blocks, strict=True):
            skip = skips.pop()
            x = torch.cat([x[:, :, : skip.shape[-1]], skip], dim=1)
            x = up(x, masks[level], key_biases[level], time_emb)
            x = up.resample(x, masks[level])

        x = self.final_block(x, masks[0])
        return apply_mask(self.final_proj(apply_mask(x, masks[0])), masks[0])
