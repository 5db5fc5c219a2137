"""The CosyVoice3 vocoder (`CausalHiFTGenerator`): the v2 HiFT (NSF source + iSTFTNet, 24 kHz) made causal.

As the official class: causal convolutions but for two that read ahead (conv_pre the next 4 mel frames, the f0
predictor's first conv the next 3), nearest upsampling then a causal conv, an f0 predictor in float64, and an NSF
source from fixed buffers with phases repeated per frame, so any run of frames can be made alone. `finalize=False`
is the streaming call: a chunk of T mel frames gives (T - 8) * hop samples. `continue_streams` decodes only the window
the convolutions can reach (`decode_history_frames`) instead of the whole mel so far: the same samples at a bounded
cost per chunk. Batch-first: an item's audio does not depend on what it is batched with. Each difference from
`engine.vocoder.hift` and why: docs/models.md, "CosyVoice3's causal vocoder".
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
from engine.loading.yaml_config import ObjectSpec, expect_class
from engine.nn.layers import CausalConv1d, Conv1d, Linear, compute_dtype, time_mask
from engine.nn.precision import recompute_non_finite
from engine.vocoder.hift import (
    FINAL_LRELU_SLOPE,
    HIFT_OPTIONS,
    F0PredictorConfig,
    HiFTConfig,
    HiFTGenerator,
    Sine2Draws,
    Snake,
    check_options,
    hift_fields_from_yaml,
)

F0_LOOKAHEAD = 3  # the official CausalConvRNNF0Predictor's first conv: kernel 4, right padding 3
_F0_KERNEL = 3
_F0_CAUSAL_CONVS = 4
F0_HISTORY = _F0_CAUSAL_CONVS * (_F0_KERNEL - 1)  # frames before a frame that its f0 depends on
CONV_POST_KERNEL = 7
SOURCE_SEED = 0
_NOISE_BLOCK = 24000 * 10  # fixed source noise is drawn in 10 s blocks, each from its own seed: prefix-stable


@dataclass(frozen=True)
class CausalHiFTConfig(HiFTConfig):
    """`HiFTConfig` plus the conv_pre look-ahead (mel frames conv_pre reads ahead)."""

    conv_pre_look_right: int = 4

    @classmethod
    def from_yaml(cls, spec: ObjectSpec) -> CausalHiFTConfig:
        expect_class(spec, "CausalHiFTGenerator", "vocoder")
        check_options(spec, HIFT_OPTIONS | {"conv_pre_look_right"}, "CausalHiFTGenerator")
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
    """The HiFi-GAN residual block of `hift` with causal convolutions: Snake -> conv -> Snake -> conv, skip."""

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
            x = conv2(act2(conv1(act1(x)))).add_(x)  # x + the branch, into the branch's fresh tensor
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
        for _ in range(_F0_CAUSAL_CONVS):
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


def _resblock_reach(kernels: tuple[int, ...], dilations: tuple[tuple[int, ...], ...]) -> int:
    """Samples before an output that the widest of these CausalResBlocks reads (a dilated then a plain conv per
    layer)."""
    return max(sum((k - 1) * (d + 1) for d in ds) for k, ds in zip(kernels, dilations, strict=True))


def decode_history_frames(config: CausalHiFTConfig) -> int:
    """Mel frames before a sample that can change it in decode(): at each upsampling stage, the residual blocks'
    reach plus the longer of the upsampling conv's (added to the earlier stages') and the source branch's, then
    conv_post's; rounded up, plus a frame for the STFT/iSTFT windows and the reflection pads. Decoding from that
    many frames before the first wanted sample gives the samples of the whole call."""
    reach, rate = 0.0, 1  # reach in mel frames; rate: stage samples per mel frame
    stages = zip(config.upsample_rates, config.upsample_kernel_sizes, strict=True)
    for i, (up, kernel) in enumerate(stages):
        rate *= up
        down = math.prod(config.upsample_rates[i + 1 :])  # source (STFT) frames per stage sample
        source_kernels = (config.source_resblock_kernel_sizes[i],), (config.source_resblock_dilation_sizes[i],)
        source = (2 * down - 1) / (rate * down) + _resblock_reach(*source_kernels) / rate
        resblocks = _resblock_reach(config.resblock_kernel_sizes, config.resblock_dilation_sizes) / rate
        reach = max(reach + (kernel - 1) / rate, source) + resblocks
    reach += (CONV_POST_KERNEL - 1) / rate
    return math.ceil(reach) + 1


@dataclass
class VocoderStream:
    """What `CausalHiFTGenerator.continue_streams` keeps of one utterance between its chunks."""

    mel: Tensor  # [in_channels, n] fp32: the mel from frame `first_frame` on (older frames change no sample to come)
    f0: Tensor  # [frames] Hz of every frame whose f0 is final
    first_frame: int = 0
    samples_sent: int = 0


class FixedSourceDraws(NamedTuple):
    initial_phase: Tensor  # [1, harmonics + 1] cycles, U(0, 1), column 0 zero
    noise: Tensor  # [1, L, harmonics + 1], U(0, 1): the official causal source's additive noise is uniform


class CausalHiFTGenerator(HiFTGenerator):
    """Module and parameter names follow the official class, so `hift.pt` loads strictly. The layers are
    `HiFTGenerator`'s made causal (the overrides below); its STFT/iSTFT helpers are reused."""

    resblock_class = CausalResBlock
    f0_predictor_class = CausalConvRNNF0Predictor

    def __init__(self, config: CausalHiFTConfig) -> None:
        super().__init__(config)
        self._initial_phase: Tensor | None = None
        self._noise_blocks: list[Tensor] = []  # fp32 CPU, plain attributes: not in state_dict, never cast

    def _weight_normed(self) -> list[nn.Module]:
        # the f0 predictor computes its weights from g and v in float64 (`_float64_weight`), as the official one
        predictor = set(self.f0_predictor.modules())
        return [m for m in super()._weight_normed() if m not in predictor]

    def _pre_conv(self, in_channels: int, out_channels: int) -> nn.Conv1d:
        """Reads the next conv_pre_look_right mel frames."""
        return LookAheadConv1d(in_channels, out_channels, self.config.conv_pre_look_right + 1)

    def _upsample_conv(self, in_channels: int, out_channels: int, kernel_size: int, rate: int) -> nn.Module:
        return CausalUpsample(in_channels, out_channels, kernel_size, rate)

    def _source_down_conv(self, in_channels: int, out_channels: int, rate: int) -> nn.Conv1d:
        if rate == 1:
            return CausalConv1d(in_channels, out_channels, 1)
        return CausalDownsample(in_channels, out_channels, rate * 2, rate)

    def _post_conv(self, in_channels: int, out_channels: int) -> nn.Conv1d:
        return CausalConv1d(in_channels, out_channels, CONV_POST_KERNEL)

    def fixed_source_draws(self, samples: int, start: int = 0) -> FixedSourceDraws:
        """The source's fixed draws, noise for samples start .. samples - 1 (the same values in every call)."""
        harmonics = self.config.nb_harmonics + 1
        if self._initial_phase is None:
            phase = torch.rand(1, harmonics, generator=torch.Generator().manual_seed(SOURCE_SEED))
            self._initial_phase = torch.cat([torch.zeros(1, 1), phase[:, 1:]], dim=1)
        while len(self._noise_blocks) * _NOISE_BLOCK < samples:
            generator = torch.Generator().manual_seed(SOURCE_SEED + 1 + len(self._noise_blocks))
            self._noise_blocks.append(torch.rand(1, _NOISE_BLOCK, harmonics, generator=generator))
        first_block = start // _NOISE_BLOCK
        blocks = self._noise_blocks[first_block : -(-samples // _NOISE_BLOCK)]
        offset = first_block * _NOISE_BLOCK
        noise = torch.cat([torch.zeros(1, 0, harmonics), *blocks], dim=1)[:, start - offset : samples - offset]
        return FixedSourceDraws(self._initial_phase.to(self.device), noise.to(self.device))

    def fixed_source(self, f0: Tensor, first_frame: int = 0) -> Tensor:
        """f0: [B, T] Hz per frame -> the source of frames first_frame .. T - 1 from the fixed draws."""
        hop = self.config.hop
        return self.source_from_draws(f0, self.fixed_source_draws(f0.shape[-1] * hop, first_frame * hop), first_frame)

    def source_from_draws(self, f0: Tensor, draws: Sine2Draws | FixedSourceDraws, first_frame: int = 0) -> Tensor:
        """f0: [B, T] Hz per frame -> source [B, 1, (T - first_frame) * hop] fp32 of frames first_frame .. T - 1,
        from the given draws (`draws.noise` [B, (T - first_frame) * hop, harmonics + 1]: those samples' noise).

        The official SineGen2 with nearest phase upsampling, computed per frame: its down-interpolation reads the
        two middle samples of each frame, which hold the frame's own f0, so the frame phase is the cumulative sum
        of each frame's cycles (the same float operations; the initial phase, added at sample 0 only, is never
        read). Hence the frames from `first_frame` on equal the whole call's, for a sum over the earlier frames.
        """
        sine, hop = self.m_source.l_sin_gen, self.config.hop
        f0 = f0.float()
        multiples = torch.arange(1, sine.harmonics + 1, device=f0.device, dtype=f0.dtype)[None, :, None]
        cycles = (f0[:, None, :] * multiples / sine.sampling_rate) % 1
        frame_phase = (torch.cumsum(cycles, dim=-1) * 2 * math.pi)[:, :, first_frame:]
        f0_samples = f0[:, first_frame:].repeat_interleave(hop, dim=-1)
        phase = (frame_phase * hop).repeat_interleave(hop, dim=-1)
        return self.m_source.merge(sine.excitation(phase, f0_samples, draws.noise.transpose(1, 2)))

    def decode(
        self, mel: Tensor, source: Tensor, lengths: Tensor | None = None, finalize: bool | Tensor = True
    ) -> Tensor:
        """mel: [B, in_channels, T], source: [B, 1, T*hop], lengths: [B] frames (default all T), finalize: for all
        items or per item ([B] bool) -> waveform [B, T*hop] fp32 clamped to +-audio_limit, 0 past each item's
        samples: lengths*hop, or with finalize False (the last conv_pre_look_right frames are look-ahead only)
        (lengths - look_right - 1)*hop.
        """
        lengths = self._checked_lengths(mel, lengths)
        config = self.config
        batch, _, frames = mel.shape
        if source.shape != (batch, 1, frames * config.hop):
            raise InvalidInputError(f"source must be [{batch}, 1, {frames * config.hop}], got {tuple(source.shape)}")
        final = torch.as_tensor(finalize, dtype=torch.bool, device=lengths.device).expand(batch)
        look_right = torch.where(final, 0, config.conv_pre_look_right)
        held = self.held_frames(final)
        if bool((lengths <= held).any()):
            needed = config.conv_pre_look_right + 1
            raise InvalidInputError(f"with finalize=False each mel needs more than {needed} frames")
        spectrum_frames = frames * config.hop // config.istft_hop + 1
        source_spectrum = self._source_spectrum(source[:, 0], lengths * config.hop, spectrum_frames)

        dtype = compute_dtype(self.conv_pre.bias.dtype)
        x = self.conv_pre(mel.to(dtype) * time_mask(lengths, frames, dtype))
        stage_lengths = lengths - look_right
        kernels = len(config.resblock_kernel_sizes)
        for i, (up, rate) in enumerate(zip(self.ups, config.upsample_rates, strict=True)):
            x = up(F.leaky_relu(x, config.lrelu_slope))
            stage_lengths = stage_lengths * rate
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # the official ReflectionPad1d((1, 0))
                stage_lengths = stage_lengths + 1
            # causal from here on: what lies past an item's end never reaches its own samples
            x = self.source_resblocks[i](self.source_downs[i](source_spectrum)).add_(x)
            stage = self.resblocks[i * kernels : (i + 1) * kernels]
            total = stage[0](x)
            for block in stage[1:]:
                total.add_(block(x))
            x = total.div_(kernels)
        x = self.conv_post(F.leaky_relu(x, FINAL_LRELU_SLOPE))
        speech = self._waveform(x, stage_lengths)
        return speech * time_mask((lengths - held) * config.hop, speech.shape[-1], speech.dtype)[:, 0]

    def held_frames(self, finalize: Tensor) -> Tensor:
        """[B] bool -> [B] mel frames at the end whose samples decode() does not give: none when finalizing, else
        the look-ahead frames and one more, the last hop of samples, which lacks its iSTFT overlap."""
        return torch.where(finalize, 0, self.config.conv_pre_look_right + 1)

    def start_stream(self) -> VocoderStream:
        """The state of an utterance to be vocoded chunk by chunk (`continue_streams`), before its first chunk."""
        mel = torch.zeros(self.config.in_channels, 0, device=self.device)
        return VocoderStream(mel=mel, f0=mel.new_zeros(0))

    @torch.inference_mode()
    def inference(
        self, mels: list[Tensor], seeds: list[int | None] | None = None, finalize: bool = True
    ) -> list[Tensor]:
        """mels: each [in_channels, T_i] -> each waveform: [T_i * hop], or with finalize=False (a streaming chunk
        whose last frames are look-ahead) [(T_i - 8) * hop] for the released look-aheads (3 f0 + 4 conv_pre + 1).

        `seeds` is accepted for the v1/v2 signature and unused: the v3 source is the same fixed draw for every call.
        A waveform that is not finite at reduced precision (from a finite mel) is computed again in fp32 (see
        engine.nn.precision.recompute_non_finite).
        """
        config = self.config
        needed = 1 if finalize else F0_LOOKAHEAD + config.conv_pre_look_right + 2
        for mel in mels:
            if mel.dim() != 2 or mel.shape[0] != config.in_channels or mel.shape[1] < needed:
                raise InvalidInputError(
                    f"each mel must be [{config.in_channels}, T >= {needed}], got {tuple(mel.shape)}"
                )
        waves = self.continue_streams([self.start_stream() for _ in mels], mels, [finalize] * len(mels))
        return recompute_non_finite(
            "vocoder",
            waves,
            self.conv_pre.bias.dtype,
            lambda index: self.inference([mels[index]], finalize=finalize)[0],
            inputs=mels,
        )

    @torch.inference_mode()
    def continue_streams(self, streams: list[VocoderStream], mels: list[Tensor], finalize: list[bool]) -> list[Tensor]:
        """Append each stream's new mel frames ([in_channels, n_i], n_i >= 0) and return its new samples [N_i] fp32:
        what the official streaming call, inference() over every frame so far with `finalize`, yields past the
        samples already returned. The streams advance; all of them go through decode() as one batch.

        Only a window is decoded: the frames from `decode_history_frames` before the first new sample on (each
        stream keeps them), with the source of those frames from the f0 of all (the source phase sums over them).
        A stream whose frames are all sent (or that has none) gets no samples.
        """
        if not streams:
            return []
        device, hop = self.device, self.config.hop
        history = decode_history_frames(self.config)
        windows, tracks = [], []
        for stream, mel, final in zip(streams, mels, finalize, strict=True):
            window = torch.cat([stream.mel, mel.to(device, stream.mel.dtype)], dim=1)
            new_f0 = self.f0_predictor(window[None], final)[0] if window.shape[1] else window.new_zeros(0)
            # f0 of a frame depends on the F0_HISTORY frames before it: the window starts early enough for the new
            # frames' (earlier frames keep the values they had; the whole call computes them alike)
            tracks.append(torch.cat([stream.f0, new_f0[len(stream.f0) - stream.first_frame :].float()]))
            windows.append(window)
        lengths = [len(track) - stream.first_frame for track, stream in zip(tracks, streams, strict=True)]
        live = [i for i, n in enumerate(lengths) if n > 0]
        outputs = [torch.zeros(0, device=device) for _ in streams]
        if live:
            width = max(lengths[i] for i in live)
            batch = torch.stack([F.pad(windows[i][:, : lengths[i]], (0, width - lengths[i])) for i in live])
            sources = [self.fixed_source(tracks[i][None], streams[i].first_frame) for i in live]
            source = torch.cat([F.pad(s, (0, width * hop - s.shape[-1])) for s in sources])
            final = torch.tensor([finalize[i] for i in live], device=device)
            frame_counts = torch.tensor([lengths[i] for i in live], device=device)
            speech = self.decode(batch, source, frame_counts, final)
            ends = ((frame_counts - self.held_frames(final)) * hop).tolist()
            for row, i in enumerate(live):
                outputs[i] = speech[row, streams[i].samples_sent - streams[i].first_frame * hop : ends[row]]
        for stream, window, track, output in zip(streams, windows, tracks, outputs, strict=True):
            stream.samples_sent += len(output)
            first = max(stream.first_frame, min(stream.samples_sent // hop - history, len(track) - F0_HISTORY))
            stream.mel = window[:, first - stream.first_frame :]
            stream.first_frame, stream.f0 = first, track
        return outputs
