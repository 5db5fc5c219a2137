"""The CosyVoice3 vocoder (`CausalHiFTGenerator`): the v2 HiFT (NSF source + iSTFTNet, 24 kHz) made causal.

Differences from engine/hift.py's `HiFTGenerator`, as in the official class:
- every convolution is causal (zeros on the left) except two that look right: conv_pre (k5) reads the next 4 mel
  frames and the f0 predictor's first conv (k4) the next 3;
- upsampling is nearest x rate followed by a causal conv (no transposed conv); the source downsampling convs are
  causal too;
- the f0 predictor (`CausalConvRNNF0Predictor`) runs in float64, whatever the weights' dtype: the source phase
  integrates f0 over the whole utterance, and the official code moves the predictor to float64 for that;
- the NSF source is not random per call: a fixed initial phase and a fixed uniform noise sequence (the official
  buffers), and frame phases are repeated (nearest) rather than interpolated up to the sample rate. The official
  buffers come from the global RNG state at construction, which depends on the whole model build; this engine
  draws its own once from a seeded generator, so parity is checked on `decode(mel, source)` with the recorded
  source and on the source from the recorded buffers.

`finalize=False` is the streaming call: the last frames are look-ahead only. The f0 predictor then yields
T - 3 frames; decode consumes 4 more as conv_pre look-ahead and drops the last hop of samples, whose iSTFT
overlap is incomplete, so a chunk of T mel frames gives (T - 8) * hop samples.

Batch-first: items are right-padded; because only the two look-right convolutions read ahead and their inputs
are zeroed past each item, an item's audio does not depend on what it is batched with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm

from engine.errors import CheckpointError, InvalidInputError
from engine.flow_v2 import CausalConv1d
from engine.hift import (
    _FINAL_LRELU_SLOPE,
    _HIFT_OPTIONS,
    F0PredictorConfig,
    HiFTConfig,
    HiFTGenerator,
    Sine2Draws,
    Snake,
    SourceModuleHnNSF,
    _check_options,
    _length_mask,
    hift_fields_from_yaml,
)
from engine.layers import Conv1d, Linear, compute_dtype
from engine.precision import recompute_non_finite
from engine.yaml_config import ObjectSpec

F0_LOOKAHEAD = 3  # the official CausalConvRNNF0Predictor's first conv: kernel 4, right padding 3
_F0_KERNEL = 3
SOURCE_SEED = 0
_NOISE_BLOCK = 24000 * 10  # fixed source noise is drawn in 10 s blocks, each from its own seed: prefix-stable


@dataclass(frozen=True)
class CausalHiFTConfig(HiFTConfig):
    """`HiFTConfig` plus the conv_pre look-ahead (mel frames conv_pre reads ahead)."""

    conv_pre_look_right: int = 4

    @classmethod
    def from_yaml(cls, spec: ObjectSpec) -> CausalHiFTConfig:
        if not isinstance(spec, ObjectSpec) or spec.class_name != "CausalHiFTGenerator":
            name = spec.class_name if isinstance(spec, ObjectSpec) else type(spec).__name__
            raise CheckpointError(f"unsupported vocoder {name!r}; expected the CosyVoice3 CausalHiFTGenerator")
        _check_options(spec, _HIFT_OPTIONS | {"conv_pre_look_right"}, "CausalHiFTGenerator")
        if "f0_predictor" not in spec.kwargs:
            raise CheckpointError("the CausalHiFTGenerator config has no f0_predictor")
        config = cls(
            **hift_fields_from_yaml(spec),
            f0_predictor=F0PredictorConfig.from_yaml(spec["f0_predictor"], "CausalConvRNNF0Predictor"),
            conv_pre_look_right=int(spec.get("conv_pre_look_right", 4)),
        )
        config.validate()
        if config.sine_generator != "SineGen2":
            raise CheckpointError("the CosyVoice3 vocoder needs the 24 kHz SineGen2 source")
        return config


class LookAheadConv1d(Conv1d):
    """Stride-1 Conv1d over zeros on the right only: output t reads inputs t .. t + kernel - 1."""

    def forward(self, x: Tensor) -> Tensor:
        """[B, in_channels, T] -> [B, out_channels, T]."""
        return super().forward(F.pad(x, (0, self.kernel_size[0] - 1)))


class CausalUpsample(CausalConv1d):
    """Nearest-neighbour x rate, then a causal conv (the official CausalConv1dUpsample)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, rate: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)
        self.rate = rate

    def forward(self, x: Tensor) -> Tensor:
        """[B, in_channels, T] -> [B, out_channels, rate T]."""
        return super().forward(x.repeat_interleave(self.rate, dim=-1))


class CausalDownsample(Conv1d):
    """Conv1d of kernel 2 rate and stride rate over rate - 1 left zeros (the official CausalConv1dDownSample)."""

    def forward(self, x: Tensor) -> Tensor:
        """[B, in_channels, T] -> [B, out_channels, (T - 1) // stride + 1]."""
        return super().forward(F.pad(x, (self.stride[0] - 1, 0)))


class CausalResBlock(nn.Module):
    """The HiFi-GAN residual block of engine.hift with causal convolutions: Snake -> conv -> Snake -> conv, skip."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(CausalConv1d(channels, channels, kernel_size, dilation=d)) for d in dilations
        )
        self.convs2 = nn.ModuleList(weight_norm(CausalConv1d(channels, channels, kernel_size)) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, T] -> [B, C, T]"""
        for act1, conv1, act2, conv2 in zip(
            self.activations1, self.convs1, self.activations2, self.convs2, strict=True
        ):
            x = x + conv2(act2(conv1(act1(x))))
        return x


def _float64_weight(conv: nn.Conv1d) -> Tensor:
    """The weight-normed weight g v / |v| computed in float64, as the official float64 predictor does."""
    parts = conv.parametrizations.weight
    g, v = parts.original0.double(), parts.original1.double()
    return g * v / v.flatten(1).norm(dim=1).reshape(g.shape)


class CausalConvRNNF0Predictor(nn.Module):
    """f0 in Hz per mel frame: a look-ahead conv k4 then 4 causal convs k3 (each -> ELU), a linear layer, abs."""

    def __init__(self, config: F0PredictorConfig) -> None:
        super().__init__()
        channels = config.cond_channels
        layers: list[nn.Module] = [weight_norm(LookAheadConv1d(config.in_channels, channels, F0_LOOKAHEAD + 1))]
        for _ in range(4):
            layers += [nn.ELU(), weight_norm(CausalConv1d(channels, channels, _F0_KERNEL))]
        self.condnet = nn.Sequential(*layers, nn.ELU())
        self.classifier = Linear(channels, 1)

    def forward(self, mel: Tensor, finalize: bool = True) -> Tensor:
        """mel [B, in_channels, T] -> f0 [B, T] (finalize) or [B, T - 3] (the last 3 frames are look-ahead only),
        computed in float64 and returned as float32."""
        x = mel.double()
        for layer in self.condnet:
            if isinstance(layer, nn.Conv1d):
                pad = (0, layer.kernel_size[0] - 1) if isinstance(layer, LookAheadConv1d) else (_F0_KERNEL - 1, 0)
                x = F.conv1d(F.pad(x, pad), _float64_weight(layer), layer.bias.double())
            else:
                x = layer(x)
        if not finalize:
            x = x[:, :, :-F0_LOOKAHEAD]
        weight, bias = self.classifier.weight.double(), self.classifier.bias.double()
        return F.linear(x.transpose(1, 2), weight, bias).squeeze(-1).abs().float()


class FixedSourceDraws(NamedTuple):
    initial_phase: Tensor  # [1, harmonics + 1] cycles, U(0, 1), column 0 zero
    noise: Tensor  # [1, L, harmonics + 1], U(0, 1): the official causal source's additive noise is uniform


class CausalHiFTGenerator(HiFTGenerator):
    """Module and parameter names follow the official class, so `hift.pt` loads strictly."""

    def __init__(self, config: CausalHiFTConfig) -> None:
        nn.Module.__init__(self)  # the layers differ from HiFTGenerator's; its STFT/iSTFT helpers are reused
        config.validate()
        self.config = config
        base = config.base_channels
        rates = config.upsample_rates
        stage_channels = [base // 2 ** (i + 1) for i in range(len(rates))]
        spectrum_channels = config.n_fft + 2

        self.m_source = SourceModuleHnNSF(config)
        self.m_source.l_sin_gen.phase_upsampling = "nearest"
        self.conv_pre = weight_norm(LookAheadConv1d(config.in_channels, base, config.conv_pre_look_right + 1))
        self.ups = nn.ModuleList(
            weight_norm(CausalUpsample(base // 2**i, channels, k, u))
            for i, (u, k, channels) in enumerate(zip(rates, config.upsample_kernel_sizes, stage_channels, strict=True))
        )
        later_rates = [math.prod(rates[i + 1 :]) for i in range(len(rates))]  # source rate of stage i
        self.source_downs = nn.ModuleList(
            CausalConv1d(spectrum_channels, channels, 1)
            if rate == 1
            else CausalDownsample(spectrum_channels, channels, rate * 2, rate)
            for rate, channels in zip(later_rates, stage_channels, strict=True)
        )
        self.source_resblocks = nn.ModuleList(
            CausalResBlock(channels, k, d)
            for channels, k, d in zip(
                stage_channels, config.source_resblock_kernel_sizes, config.source_resblock_dilation_sizes, strict=True
            )
        )
        self.resblocks = nn.ModuleList(
            CausalResBlock(channels, k, d)
            for channels in stage_channels
            for k, d in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = weight_norm(CausalConv1d(stage_channels[-1], spectrum_channels, 7))
        self.f0_predictor = CausalConvRNNF0Predictor(config.f0_predictor)
        window = torch.hann_window(config.n_fft, periodic=True, dtype=torch.float64).float()
        self.register_buffer("stft_window", window, persistent=False)
        self._initial_phase: Tensor | None = None
        self._noise_blocks: list[Tensor] = []  # fp32 CPU, plain attributes: not in state_dict, never cast

    def fixed_source_draws(self, samples: int) -> FixedSourceDraws:
        """The source's fixed draws for the first `samples` samples (the same prefix for every call)."""
        harmonics = self.config.nb_harmonics + 1
        if self._initial_phase is None:
            phase = torch.rand(1, harmonics, generator=torch.Generator().manual_seed(SOURCE_SEED))
            self._initial_phase = torch.cat([torch.zeros(1, 1), phase[:, 1:]], dim=1)
        while len(self._noise_blocks) * _NOISE_BLOCK < samples:
            generator = torch.Generator().manual_seed(SOURCE_SEED + 1 + len(self._noise_blocks))
            self._noise_blocks.append(torch.rand(1, _NOISE_BLOCK, harmonics, generator=generator))
        noise = torch.cat(self._noise_blocks, dim=1)[:, :samples]
        return FixedSourceDraws(self._initial_phase.to(self.device), noise.to(self.device))

    def source_from_draws(self, f0: Tensor, draws: Sine2Draws | FixedSourceDraws) -> Tensor:
        """f0: [B, T] Hz per frame -> source [B, 1, T*hop] fp32 from the given draws (see `fixed_source_draws`)."""
        return super().source_from_draws(f0, Sine2Draws(*draws))

    def decode(self, mel: Tensor, source: Tensor, lengths: Tensor | None = None, finalize: bool = True) -> Tensor:
        """mel: [B, in_channels, T], source: [B, 1, T*hop], lengths: [B] frames (default all T)
        -> waveform [B, T*hop] fp32 clamped to +-audio_limit, 0 past each item's samples: lengths*hop, or with
        finalize=False (the last conv_pre_look_right frames are look-ahead only) (lengths - look_right - 1)*hop.
        """
        lengths = self._checked_lengths(mel, lengths)
        config = self.config
        batch, _, frames = mel.shape
        if source.shape != (batch, 1, frames * config.hop):
            raise InvalidInputError(f"source must be [{batch}, 1, {frames * config.hop}], got {tuple(source.shape)}")
        look_right = 0 if finalize else config.conv_pre_look_right
        if bool((lengths <= look_right + (0 if finalize else 1)).any()):
            raise InvalidInputError(f"with finalize=False each mel needs more than {look_right + 1} frames")
        spectrum_frames = frames * config.hop // config.istft_hop + 1
        source_spectrum = self._source_spectrum(source[:, 0], lengths * config.hop, spectrum_frames)

        dtype = compute_dtype(self.conv_pre.bias.dtype)
        x = self.conv_pre(mel.to(dtype) * _length_mask(lengths, frames, dtype))
        stage_lengths = lengths - look_right
        kernels = len(config.resblock_kernel_sizes)
        for i, (up, rate) in enumerate(zip(self.ups, config.upsample_rates, strict=True)):
            x = up(F.leaky_relu(x, config.lrelu_slope))
            stage_lengths = stage_lengths * rate
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # the official ReflectionPad1d((1, 0))
                stage_lengths = stage_lengths + 1
            # causal from here on: what lies past an item's end never reaches its own samples
            x = x + self.source_resblocks[i](self.source_downs[i](source_spectrum))
            stage = self.resblocks[i * kernels : (i + 1) * kernels]
            total = stage[0](x)
            for block in stage[1:]:
                total = total + block(x)
            x = total / kernels
        x = self.conv_post(F.leaky_relu(x, _FINAL_LRELU_SLOPE))
        speech = self._waveform(x, stage_lengths)
        if finalize:
            return speech
        kept = (lengths - look_right - 1) * config.hop  # the last hop of samples lacks its iSTFT overlap
        return speech * _length_mask(kept, speech.shape[-1], speech.dtype)[:, 0]

    @torch.inference_mode()
    def inference(
        self, mels: list[Tensor], seeds: list[int | None] | None = None, finalize: bool = True
    ) -> list[Tensor]:
        """mels: each [in_channels, T_i] -> each waveform: [T_i * hop], or with finalize=False (a streaming chunk
        whose last frames are look-ahead) [(T_i - 8) * hop] for the released look-aheads (3 f0 + 4 conv_pre + 1).

        `seeds` is accepted for the v1/v2 signature and unused: the v3 source is the same fixed draw for every call.
        A waveform that is not finite at reduced precision (from a finite mel) is computed again in fp32 (see
        engine.precision.recompute_non_finite).
        """
        if not mels:
            return []
        config = self.config
        needed = 1 if finalize else F0_LOOKAHEAD + config.conv_pre_look_right + 2
        for mel in mels:
            if mel.dim() != 2 or mel.shape[0] != config.in_channels or mel.shape[1] < needed:
                raise InvalidInputError(
                    f"each mel must be [{config.in_channels}, T >= {needed}], got {tuple(mel.shape)}"
                )
        device, hop = self.device, config.hop
        f0 = [self.f0_predictor(mel[None].to(device), finalize)[0] for mel in mels]  # per item, see predict_f0
        sources = [self.source_from_draws(f[None], self.fixed_source_draws(len(f) * hop)) for f in f0]
        lengths = torch.tensor([len(f) for f in f0], device=device)
        width = int(lengths.max())
        batch = torch.stack(
            [F.pad(mel[:, : len(f)].to(device), (0, width - len(f))) for mel, f in zip(mels, f0, strict=True)]
        )
        source = torch.cat([F.pad(s, (0, (width - s.shape[-1] // hop) * hop)) for s in sources])
        speech = self.decode(batch, source, lengths, finalize)
        samples = lengths * hop if finalize else (lengths - config.conv_pre_look_right - 1) * hop
        return recompute_non_finite(
            "vocoder",
            [speech[i, :n] for i, n in enumerate(samples.tolist())],
            self.conv_pre.bias.dtype,
            lambda index: self.inference([mels[index]], finalize=finalize)[0],
            inputs=mels,
        )
