"""The CosyVoice2 causal flow (`CausalMaskedDiffWithXvec`): speech tokens -> 80-bin mel, batched over requests.

Tokens (prompt + target) are embedded and encoded by the `UpsampleConformerEncoder`: a linear input layer, a
pre-lookahead convolution that reads the next 3 tokens, rel-pos Conformer blocks, a causal x2 upsampling to mel
frames and 4 more Conformer blocks. The result is projected to 80 channels and a flow-matching ODE is integrated
with classifier-free guidance, using a causal 1-D U-Net (`CausalConditionalDecoder`) as the velocity field.

Unlike v1, the ODE always starts from the same fixed noise: the first frames of one [1, 80, 15000] draw of a
generator seeded with 0, so `FlowRequest.noise` and `FlowRequest.seed` are ignored here. In streaming mode the
attention of both the encoder and the estimator is limited to static chunks. Requests of any lengths share one
right-padded batch; key masks in every attention and zeros before the one convolution that looks right keep
each request identical to its own unbatched result (every other convolution only looks left).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import InvalidInputError
from engine.flow.estimator import (
    ResnetBlock1D,
    TimestepEmbedding,
    TransformerBlock,
    UNetLevel,
    sinusoidal_time_embedding,
)
from engine.flow.masked_diff import (
    CFMConfig,
    ConditionalCFM,
    FlowRequest,
    check_flow_request,
    embed_flow_tokens,
    prompt_condition,
    require_unet_io,
    speaker_vectors,
    target_frames,
    unet_activation_bytes,
)
from engine.loading.yaml_config import ObjectSpec, expect_class, require
from engine.nn.conformer import OUTER_EPS, EncoderBlock, EncoderConfig, InputLayer
from engine.nn.layers import CausalConv1d, Conv1d, LayerNorm, Linear, apply_mask, length_mask

# The official UpsampleConformerEncoder hard-codes these instead of reading them from the config.
ENCODER_WIDTH = 512
UPSAMPLE_STRIDE = 2
LOOKAHEAD_TOKENS = 3
NUM_UP_BLOCKS = 4
# The fixed CFM start noise: one draw of a generator seeded with 0; 15000 frames are 5 minutes at 50 frames/s.
NOISE_SEED = 0
NOISE_FRAMES = 15000
_CAUSAL_KERNEL = 3  # the estimator's causal convolutions
_LOOKAHEAD_OUT_KERNEL = 3  # the left-padded second convolution of the pre-lookahead layer
_LEAKY_SLOPE = 0.01


@dataclass(frozen=True)
class CausalEstimatorConfig:
    in_channels: int  # x, mu, spks and cond stacked: 4 x 80
    out_channels: int
    channels: int  # the single U-Net resolution
    attention_head_dim: int
    n_blocks: int  # transformer blocks per level
    num_mid_blocks: int
    num_heads: int
    static_chunk_size: int  # mel frames per attention chunk when streaming

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.channels

    @classmethod
    def from_yaml(cls, spec: ObjectSpec) -> CausalEstimatorConfig:
        """From the yaml `estimator` node (class `CausalConditionalDecoder`)."""
        expect_class(spec, "CausalConditionalDecoder", "flow estimator")
        act_fn = spec.get("act_fn", "snake")
        require(act_fn == "gelu", f"unsupported estimator act_fn {act_fn!r}; only 'gelu' is implemented")
        channels = tuple(spec.get("channels", (256, 256)))
        # CosyVoice2 uses one resolution, where both resampling layers are causal k3 convolutions
        require(len(channels) == 1, f"estimator channels {list(channels)} are not supported; only one level is")
        left_chunks = spec.get("num_decoding_left_chunks", -1)
        require(left_chunks == -1, f"estimator num_decoding_left_chunks={left_chunks} is not supported (only -1)")
        chunk = int(spec.get("static_chunk_size", 0))
        require(chunk > 0, f"estimator static_chunk_size must be positive, got {chunk}")
        return cls(
            in_channels=int(spec["in_channels"]),
            out_channels=int(spec["out_channels"]),
            channels=int(channels[0]),
            attention_head_dim=int(spec.get("attention_head_dim", 64)),
            n_blocks=int(spec.get("n_blocks", 1)),
            num_mid_blocks=int(spec.get("num_mid_blocks", 2)),
            num_heads=int(spec.get("num_heads", 4)),
            static_chunk_size=chunk,
        )


def _upsample_encoder_config(spec: ObjectSpec) -> EncoderConfig:
    """The Conformer block settings of an `UpsampleConformerEncoder` node; other variants are rejected."""
    expect_class(spec, "UpsampleConformerEncoder", "flow encoder")
    # Defaults as in the official constructor; anything but the CosyVoice2 variant is rejected.
    required = {
        "input_layer": ("conv2d", "linear"),
        "pos_enc_layer_type": ("rel_pos", "rel_pos_espnet"),
        "selfattention_layer_type": ("rel_selfattn", "rel_selfattn"),
        "normalize_before": (True, True),
        "use_dynamic_chunk": (False, False),
        "macaron_style": (True, False),
        "use_cnn_module": (True, False),
        "activation_type": ("swish", "swish"),
    }
    for key, (default, supported) in required.items():
        value = spec.get(key, default)
        require(
            value == supported, f"UpsampleConformerEncoder with {key}={value!r} is not supported (only {supported!r})"
        )
    sizes = (spec.get("input_size"), spec.get("output_size", 256))
    require(
        sizes == (ENCODER_WIDTH, ENCODER_WIDTH),
        f"UpsampleConformerEncoder input/output_size must be {ENCODER_WIDTH} (its conv layers hard-code it)",
    )
    return EncoderConfig(
        input_size=ENCODER_WIDTH,
        output_size=ENCODER_WIDTH,
        attention_heads=int(spec.get("attention_heads", 4)),
        linear_units=int(spec.get("linear_units", 2048)),
        num_blocks=int(spec.get("num_blocks", 6)),
        input_layer="linear",
        activation="swish",
        causal=False,  # streaming limits attention to chunks instead
        block="conformer",
    )


@dataclass(frozen=True)
class CausalFlowConfig:
    input_size: int  # token embedding width
    output_size: int  # mel bins
    spk_embed_dim: int
    vocab_size: int
    token_mel_ratio: int  # mel frames per token (the encoder's upsampling stride)
    pre_lookahead_len: int  # tokens the pre-lookahead layer reads ahead
    encoder: EncoderConfig  # the Conformer blocks of both stages
    encoder_chunk_size: int  # tokens per attention chunk when streaming (the up stage uses x token_mel_ratio)
    decoder: CFMConfig  # its estimator: a CausalEstimatorConfig

    @property
    def decoder_chunk_size(self) -> int:
        """Mel frames per estimator attention chunk when streaming."""
        return self.decoder.estimator.static_chunk_size

    @classmethod
    def from_yaml(cls, spec: ObjectSpec) -> CausalFlowConfig:
        """From the yaml `flow` node (class `CausalMaskedDiffWithXvec`)."""
        expect_class(spec, "CausalMaskedDiffWithXvec", "flow")
        encoder = spec["encoder"]
        output_type = spec.get("output_type", "mel")
        require(output_type == "mel", f"unsupported flow output_type {output_type!r}; only 'mel' is implemented")
        config = cls(
            input_size=int(spec["input_size"]),
            output_size=int(spec.get("output_size", 80)),
            spk_embed_dim=int(spec.get("spk_embed_dim", 192)),
            vocab_size=int(spec["vocab_size"]),
            token_mel_ratio=int(spec.get("token_mel_ratio", 2)),
            pre_lookahead_len=int(spec.get("pre_lookahead_len", 3)),
            encoder=_upsample_encoder_config(encoder),
            encoder_chunk_size=int(encoder.get("static_chunk_size", 0)),
            decoder=CFMConfig.from_yaml(spec["decoder"], "CausalConditionalCFM", CausalEstimatorConfig),
        )
        require(config.input_size == ENCODER_WIDTH, f"flow input_size must be {ENCODER_WIDTH}, as its encoder's")
        require(
            config.token_mel_ratio == UPSAMPLE_STRIDE,
            f"flow token_mel_ratio must be {UPSAMPLE_STRIDE}, the encoder's hard-coded upsampling stride",
        )
        require(
            config.pre_lookahead_len == LOOKAHEAD_TOKENS,
            f"flow pre_lookahead_len must be {LOOKAHEAD_TOKENS}, as the encoder's hard-coded pre-lookahead layer",
        )
        require(config.encoder_chunk_size > 0, "the flow encoder needs a positive static_chunk_size")
        require_unet_io(config.decoder.estimator, config.output_size)
        return config

    def mel_frames_of(self, speech_tokens: int) -> int:
        """Mel frames the flow makes from `speech_tokens` tokens."""
        return speech_tokens * self.token_mel_ratio

    def activation_bytes(self, frames: int, dtype_bytes: int) -> int:
        """Peak bytes of the flow's activations over `frames` mel frames (its estimator's)."""
        estimator = self.decoder.estimator
        return unet_activation_bytes(estimator, estimator.channels, frames, dtype_bytes)


def chunk_attention_mask(valid: Tensor, chunk_size: int) -> Tensor:
    """valid [B, T] (real positions) -> [B, T, T] bool, True where query i may attend to key j.

    Keys must be valid; with chunk_size > 0 query i also sees only keys j < (i // chunk_size + 1) * chunk_size
    (its own chunk and all earlier ones). Every query may attend to itself, so no softmax row is empty: the
    padded queries stay finite, and their outputs are never used.
    """
    positions = torch.arange(valid.shape[1], device=valid.device)
    allowed = valid[:, None, :]
    if chunk_size > 0:
        chunk_end = (positions[:, None] // chunk_size + 1) * chunk_size
        allowed = allowed & (positions[None, :] < chunk_end)
    return allowed | (positions[:, None] == positions[None, :])


class ChannelsLast(nn.Module):
    """Swaps the channel and time axes, so that a LayerNorm normalises over channels."""

    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        # the official layout: causal conv, transpose, LayerNorm over channels, transpose back, Mish
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, _CAUSAL_KERNEL), ChannelsLast(), LayerNorm(dim_out), ChannelsLast(), nn.Mish()
        )

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """x: [B, dim, T], mask: [B, 1, T] or None (no padding) -> [B, dim_out, T], zero on padded frames."""
        return apply_mask(self.block(apply_mask(x, mask)), mask)


class CausalResnetBlock1D(ResnetBlock1D):
    block_class = CausalBlock1D


class CausalUNetLevel(UNetLevel):
    """One stage in the official layout: [ResNet block, transformer blocks(, causal k3 resampling conv)]; the
    attention argument of `forward` is a [B, 1, T, T] bool mask (streaming chunks) or None (attend everywhere)."""

    def __init__(self, config: CausalEstimatorConfig, dim: int, resample: bool) -> None:
        width = config.channels
        blocks = [TransformerBlock(width, config.num_heads, config.attention_head_dim) for _ in range(config.n_blocks)]
        stage: list[nn.Module] = [CausalResnetBlock1D(dim, width, config.time_embed_dim), nn.ModuleList(blocks)]
        if resample:
            stage.append(CausalConv1d(width, width, _CAUSAL_KERNEL))
        nn.ModuleList.__init__(self, stage)


class CausalConditionalDecoder(nn.Module):
    """The CosyVoice2 velocity estimator: a single-resolution causal U-Net with chunked attention when streaming."""

    def __init__(self, config: CausalEstimatorConfig) -> None:
        super().__init__()
        self.config = config
        width = config.channels
        self.time_mlp = TimestepEmbedding(config.in_channels, config.time_embed_dim)
        self.down_blocks = nn.ModuleList([CausalUNetLevel(config, config.in_channels, resample=True)])
        self.mid_blocks = nn.ModuleList(
            CausalUNetLevel(config, width, resample=False) for _ in range(config.num_mid_blocks)
        )
        self.up_blocks = nn.ModuleList([CausalUNetLevel(config, 2 * width, resample=True)])  # the skip is stacked on
        self.final_block = CausalBlock1D(width, width)
        self.final_proj = Conv1d(width, config.out_channels, 1)

    def forward(
        self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, streaming: bool = False
    ) -> Tensor:
        """Velocity of the flow at time t.

        x, mu, cond: [B, 80, T]; mask: [B, 1, T] (1 = valid frame); t: [B]; spks: [B, 80] -> [B, out_channels, T].
        """
        time_emb = self.time_mlp(sinusoidal_time_embedding(t, self.config.in_channels))
        x = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1)

        # a batch without padding skips the frame masks, and also the attention mask unless streaming
        valid = mask[:, 0].bool()
        padded = not bool(valid.all())
        frame_mask = mask if padded else None
        attention = None
        if padded or streaming:
            chunk = self.config.static_chunk_size if streaming else 0
            attention = chunk_attention_mask(valid, chunk).unsqueeze(1)

        skips = []
        for down in self.down_blocks:
            x = down(x, frame_mask, attention, time_emb)
            skips.append(x)
            x = down.resample(x, frame_mask)
        for mid in self.mid_blocks:
            x = mid(x, frame_mask, attention, time_emb)
        for up in self.up_blocks:
            x = up(torch.cat([x, skips.pop()], dim=1), frame_mask, attention, time_emb)
            x = up.resample(x, frame_mask)
        x = self.final_block(x, frame_mask)
        return apply_mask(self.final_proj(apply_mask(x, frame_mask)), frame_mask)


class CausalConditionalCFM(ConditionalCFM):
    """The CFM solver started from the fixed noise instead of a per-request draw (v2 and v3)."""

    def __init__(self, inference_cfg_rate: float, mel_bins: int, estimator: nn.Module) -> None:
        """`estimator(x, mask, mu, t, spks, cond, streaming=)` is the velocity field (v2 U-Net, v3 DiT)."""
        super().__init__(inference_cfg_rate, estimator)
        self.mel_bins = mel_bins
        # fp32 on CPU, built on first use; a plain attribute, so neither state_dict nor .to(dtype) touch it
        self._fixed_noise: Tensor | None = None

    def start_noise(self, frames: int) -> Tensor:
        """The ODE start of every request: the first `frames` frames of the fixed draw, fp32 CPU [1, 80, frames]."""
        if frames > NOISE_FRAMES:
            raise InvalidInputError(f"the flow can generate at most {NOISE_FRAMES} mel frames, {frames} were asked")
        if self._fixed_noise is None:
            # a private generator: the official code reseeds the global RNGs instead, which we must not do
            generator = torch.Generator().manual_seed(NOISE_SEED)
            self._fixed_noise = torch.randn(1, self.mel_bins, NOISE_FRAMES, generator=generator)
        return self._fixed_noise[:, :, :frames]

    def forward(  # no `noise` argument: it is the fixed one
        self, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, n_timesteps: int = 10, streaming: bool = False
    ) -> Tensor:
        """Integrate from the fixed noise at t=0 to the mel at t=1.

        mu: [B, C_mu, T]; cond: [B, 80, T]; mask: [B, 1, T]; spks: [B, 80] -> [B, 80, T] fp32.
        """
        batch, _, frames = mu.shape
        # every request starts at noise frame 0, so one prefix serves all rows of the padded batch
        noise = self.start_noise(frames).to(mu.device).expand(batch, -1, -1)
        return super().forward(noise, mu, mask, spks, cond, n_timesteps, streaming=streaming)


class PreLookaheadLayer(nn.Module):
    """Mixes each token with the next `lookahead` ones: Conv1d k(lookahead+1) over right zeros, leaky ReLU,
    a causal Conv1d k3, plus the residual."""

    def __init__(self, channels: int, lookahead: int, hidden: int | None = None) -> None:
        """`hidden`: the width between the two convolutions (v3: 1024 around 80 channels); default `channels`."""
        super().__init__()
        self.lookahead = lookahead
        hidden = channels if hidden is None else hidden
        self.conv1 = Conv1d(channels, hidden, lookahead + 1)
        self.conv2 = Conv1d(hidden, channels, _LOOKAHEAD_OUT_KERNEL)

    def forward(self, x: Tensor, readable: Tensor) -> Tensor:
        """x: [B, T, C] embedded frames, readable: [B, T] bool (frames the look-ahead may read: the request's
        tokens and any held-back context tokens after them) -> [B, T, C]; only frames before the context are used.
        """
        # zeroing the rest makes every row read zeros past its end, as a request alone does
        h = (x * readable.unsqueeze(-1).to(x.dtype)).transpose(1, 2)
        h = F.leaky_relu(self.conv1(F.pad(h, (0, self.lookahead))), _LEAKY_SLOPE)
        h = self.conv2(F.pad(h, (_LOOKAHEAD_OUT_KERNEL - 1, 0)))
        return x + h.transpose(1, 2)


class Upsample1D(nn.Module):
    """Nearest-neighbour x stride, then a causal Conv1d k(2 stride + 1)."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = CausalConv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, T] -> [B, C, stride T]."""
        return self.conv(F.interpolate(x, scale_factor=float(self.stride), mode="nearest"))


class UpsampleConformerEncoder(nn.Module):
    """Token encoder of CosyVoice2: input layer, pre-lookahead, Conformer blocks, x2 upsampling, Conformer blocks."""

    def __init__(self, config: CausalFlowConfig) -> None:
        super().__init__()
        blocks = config.encoder
        self.chunk_size = config.encoder_chunk_size
        self.embed = InputLayer(blocks)
        self.pre_lookahead_layer = PreLookaheadLayer(blocks.output_size, config.pre_lookahead_len)
        self.encoders = nn.ModuleList(EncoderBlock(blocks) for _ in range(blocks.num_blocks))
        self.up_layer = Upsample1D(blocks.output_size, config.token_mel_ratio)
        self.up_embed = InputLayer(dataclasses.replace(blocks, input_size=blocks.output_size))
        self.up_encoders = nn.ModuleList(EncoderBlock(blocks) for _ in range(NUM_UP_BLOCKS))
        self.after_norm = LayerNorm(blocks.output_size, eps=OUTER_EPS)

    def forward(self, x: Tensor, lengths: Tensor, context: int, streaming: bool) -> tuple[Tensor, Tensor]:
        """x: [B, T, input_size] right-padded token embeddings, lengths: [B] tokens per row including the last
        `context` ones, which are read as look-ahead only -> ([B, stride (T - context), D], [B] frame lengths).

        Padded positions never influence valid ones; their own outputs are unspecified (finite).
        """
        encoded = lengths - context
        x = self.embed(x)
        x = self.pre_lookahead_layer(x, length_mask(lengths, x.shape[1]))[:, : x.shape[1] - context]
        chunk = self.chunk_size if streaming else 0
        mask = chunk_attention_mask(length_mask(encoded, x.shape[1]), chunk)
        for block in self.encoders:
            x = block(x, mask)

        stride = self.up_layer.stride
        x = self.up_embed(self.up_layer(x.transpose(1, 2)).transpose(1, 2))
        frame_lengths = encoded * stride
        mask = chunk_attention_mask(length_mask(frame_lengths, x.shape[1]), chunk * stride)
        for block in self.up_encoders:
            x = block(x, mask)
        return self.after_norm(x), frame_lengths


def check_causal_flow_request(config: CausalFlowConfig | Any, index: int, request: FlowRequest, context: int) -> None:
    """The request checks of the causal flows (v2, and v3's DiT flow, whose config has the same fields):
    InvalidInputError unless its tokens give mel frames past the prompt and within the fixed noise.
    `context`: tokens held back as look-ahead only (finalize=False)."""
    prompt_feat = request.prompt_feat
    check_flow_request(request, config.vocab_size, config.output_size, config.spk_embed_dim)
    encoded = request.prompt_tokens.numel() + request.tokens.numel() - context
    frames = config.token_mel_ratio * encoded
    if frames > NOISE_FRAMES:
        raise InvalidInputError(
            f"request {index} needs {frames} mel frames (prompt included); the flow can generate at most "
            f"{NOISE_FRAMES}: split its tokens"
        )
    if frames <= prompt_feat.shape[0]:
        held_back = f" (with finalize=False its last {context} tokens are look-ahead only)" if context else ""
        raise InvalidInputError(
            f"request {index} yields no mel frames after its {prompt_feat.shape[0]} prompt frames: "
            f"its tokens give {frames} frames in all{held_back}"
        )


@dataclass
class CausalFlowConditioning:
    """Everything the CFM is conditioned on, for a padded batch (mel frames include the prompt frames)."""

    encoder_out: Tensor  # [B, T_mel, D_enc] encoder output, padded past mel_lengths
    encoder_proj_out: Tensor  # [B, T_mel, 80]
    mu: Tensor  # [B, 80, T_mel] encoder_proj_out transposed
    spks: Tensor  # [B, 80] projected speaker embedding
    cond: Tensor  # [B, 80, T_mel] prompt mel in the first prompt frames, zeros after
    mask: Tensor  # [B, 1, T_mel] 1 on valid frames
    prompt_frames: list[int]  # official mel_len1 per request
    mel_lengths: list[int]  # mel_len1 + mel_len2 per request


class CausalMaskedDiffWithXvec(nn.Module):
    def __init__(self, config: CausalFlowConfig) -> None:
        super().__init__()
        self.config = config
        mel = config.output_size
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = Linear(config.spk_embed_dim, mel)
        self.encoder = UpsampleConformerEncoder(config)
        self.encoder_proj = Linear(config.encoder.output_size, mel)
        self.decoder = CausalConditionalCFM(
            config.decoder.inference_cfg_rate, mel, CausalConditionalDecoder(config.decoder.estimator)
        )

    @torch.inference_mode()
    def prepare(
        self, requests: list[FlowRequest], streaming: bool = False, finalize: bool = True
    ) -> CausalFlowConditioning:
        """Encode a batch of requests into the CFM conditioning (see CausalFlowConditioning).

        With finalize=False the last `pre_lookahead_len` tokens of each request are look-ahead context only.
        """
        if not requests:
            raise InvalidInputError("the flow needs at least one request")
        context = 0 if finalize else self.config.pre_lookahead_len
        for index, request in enumerate(requests):
            check_causal_flow_request(self.config, index, request, context)
        embedded, token_lengths, _ = embed_flow_tokens(self.input_embedding, requests)
        encoder_out, frame_lengths = self.encoder(embedded, token_lengths, context, streaming)
        encoder_proj_out = self.encoder_proj(encoder_out)
        mu = encoder_proj_out.transpose(1, 2)
        return CausalFlowConditioning(
            encoder_out=encoder_out,
            encoder_proj_out=encoder_proj_out,
            mu=mu,
            spks=speaker_vectors(self.spk_embed_affine_layer, requests),
            cond=prompt_condition(requests, mu, self.config.output_size),
            mask=length_mask(frame_lengths, mu.shape[2]).unsqueeze(1).to(mu.dtype),
            prompt_frames=[r.prompt_feat.shape[0] for r in requests],
            mel_lengths=frame_lengths.tolist(),
        )

    @torch.inference_mode()
    def inference(
        self, requests: list[FlowRequest], n_timesteps: int = 10, streaming: bool = False, finalize: bool = True
    ) -> list[Tensor]:
        """Mel of each request's target tokens (prompt frames removed): fp32 [80, mel_len2] per request.

        mel_len2 = token_mel_ratio * (prompt + target tokens, less the last pre_lookahead_len when finalize is
        False) - prompt frames. `streaming` limits attention to static chunks, as in the official streaming
        calls. The ODE starts from the fixed noise, so the requests' `noise` and `seed` are ignored.
        """
        if not requests:
            return []
        conditioning = self.prepare(requests, streaming, finalize)
        feat = self.decoder(
            conditioning.mu, conditioning.mask, conditioning.spks, conditioning.cond, n_timesteps, streaming
        )
        return target_frames(feat, conditioning.prompt_frames, conditioning.mel_lengths)
