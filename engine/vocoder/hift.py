"""HiFT vocoder (official `HiFTGenerator`): mel -> f0 -> NSF sine source -> iSTFTNet waveform.

Batch-first: every entry point takes padded batches with per-item lengths. In decode each layer re-masks its
output, so that a request in a padded batch sees exactly the zero borders it would see alone; the small f0
predictor runs per item (see `predict_f0`). Module and
parameter names reproduce the official state-dict keys (weight norm through
`torch.nn.utils.parametrizations.weight_norm`), so `load_strict` works on the official `hift.pt`.

Precision: Snake, the sine phases (long prefix sums) and the magnitude/phase/iSTFT tail compute in fp32
whatever the weight dtype, because Snake's `1/alpha` and `exp()` of the log-magnitudes overflow fp16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from engine.errors import CheckpointError, InvalidInputError
from engine.loading.checkpoint import load_strict
from engine.loading.yaml_config import ObjectSpec, expect_class
from engine.nn.layers import Conv1d, ConvTranspose1d, Linear, apply_mask, time_mask

# The official code picks the v1 `SineGen` at 22050 Hz and `SineGen2` (v2, 24 kHz) otherwise.
_SINE_GEN_SAMPLE_RATE = 22050
_SNAKE_EPS = 1e-9
_MAX_MAGNITUDE = 100.0
FINAL_LRELU_SLOPE = 0.01  # the official decode() ends with F.leaky_relu at its default slope
# the yaml options of a HiFTGenerator (CausalHiFTGenerator's are these and its own)
HIFT_OPTIONS = {
    "in_channels", "base_channels", "nb_harmonics", "sampling_rate", "nsf_alpha", "nsf_sigma",
    "nsf_voiced_threshold", "upsample_rates", "upsample_kernel_sizes", "istft_params", "resblock_kernel_sizes",
    "resblock_dilation_sizes", "source_resblock_kernel_sizes", "source_resblock_dilation_sizes", "lrelu_slope",
    "audio_limit", "f0_predictor",
}  # fmt: skip


def _int_tuple(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def check_options(spec: ObjectSpec, known: set[str], what: str) -> None:
    """CheckpointError naming the options of `spec` outside `known` (`what`: the class, for the message)."""
    unknown = sorted(set(spec.kwargs) - known)
    if unknown:
        raise CheckpointError(f"unsupported {what} options in the model config: {', '.join(unknown)}")


@dataclass(frozen=True)
class F0PredictorConfig:
    in_channels: int = 80
    cond_channels: int = 512

    @classmethod
    def from_yaml(cls, spec: ObjectSpec, class_name: str = "ConvRNNF0Predictor") -> F0PredictorConfig:
        """The yaml `f0_predictor` node, of class `class_name` (v3: `CausalConvRNNF0Predictor`)."""
        expect_class(spec, class_name, "HiFT f0 predictor")
        check_options(spec, {"num_class", "in_channels", "cond_channels"}, class_name)
        if int(spec.get("num_class", 1)) != 1:
            raise CheckpointError(f"{class_name} must predict one f0 value per frame (num_class: 1)")
        defaults = cls()
        return cls(
            in_channels=int(spec.get("in_channels", defaults.in_channels)),
            cond_channels=int(spec.get("cond_channels", defaults.cond_channels)),
        )


@dataclass(frozen=True)
class HiFTConfig:
    """Hyperparameters of the yaml `hift` node (defaults are the official v1 constructor's)."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 22050
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 8)
    upsample_kernel_sizes: tuple[int, ...] = (16, 16)
    n_fft: int = 16
    istft_hop: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_predictor: F0PredictorConfig = F0PredictorConfig()

    @property
    def hop(self) -> int:
        """Waveform samples per mel frame."""
        return math.prod(self.upsample_rates) * self.istft_hop

    @property
    def sine_generator(self) -> str:
        return "SineGen" if self.sampling_rate == _SINE_GEN_SAMPLE_RATE else "SineGen2"

    @classmethod
    def from_yaml(cls, spec: ObjectSpec) -> HiFTConfig:
        expect_class(spec, "HiFTGenerator", "vocoder")
        check_options(spec, HIFT_OPTIONS, "HiFTGenerator")
        if "f0_predictor" not in spec.kwargs:
            raise CheckpointError("the HiFTGenerator config has no f0_predictor")
        config = cls(**hift_fields_from_yaml(spec), f0_predictor=F0PredictorConfig.from_yaml(spec["f0_predictor"]))
        config.validate()
        return config

    def validate(self) -> None:
        """Raise CheckpointError for configurations this implementation cannot reproduce."""
        stages = len(self.upsample_rates)
        per_stage = (self.upsample_kernel_sizes, self.source_resblock_kernel_sizes, self.source_resblock_dilation_sizes)
        if any(len(values) != stages for values in per_stage):
            raise CheckpointError("HiFT upsample rates, kernel sizes and source resblocks need one entry per stage")
        if not all(self.resblock_dilation_sizes) or not all(self.source_resblock_dilation_sizes):
            raise CheckpointError("every HiFT resblock needs at least one dilation")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise CheckpointError("HiFT resblock kernel sizes and dilation sizes differ in length")
        if any((k - u) % 2 for u, k in zip(self.upsample_rates, self.upsample_kernel_sizes, strict=True)):
            # the official padding (k - u) // 2 only gives exactly u samples per frame when k - u is even
            raise CheckpointError("HiFT upsample kernel size minus rate must be even")
        if self.base_channels % 2**stages:
            raise CheckpointError(f"HiFT base_channels must be divisible by {2**stages}")
        if self.f0_predictor.in_channels != self.in_channels:
            raise CheckpointError("the f0 predictor and HiFT take a different number of mel channels")
        if self.n_fft % 2 or self.n_fft % self.istft_hop:
            raise CheckpointError("HiFT istft n_fft must be even and a multiple of hop_len")


def hift_fields_from_yaml(spec: ObjectSpec) -> dict[str, Any]:
    """The HiFTConfig fields of a yaml `hift` node that both generators share (all but `f0_predictor`)."""
    istft = spec.get("istft_params", {"n_fft": 16, "hop_len": 4})
    defaults = HiFTConfig()
    return dict(
        in_channels=int(spec.get("in_channels", defaults.in_channels)),
        base_channels=int(spec.get("base_channels", defaults.base_channels)),
        nb_harmonics=int(spec.get("nb_harmonics", defaults.nb_harmonics)),
        sampling_rate=int(spec.get("sampling_rate", defaults.sampling_rate)),
        nsf_alpha=float(spec.get("nsf_alpha", defaults.nsf_alpha)),
        nsf_sigma=float(spec.get("nsf_sigma", defaults.nsf_sigma)),
        nsf_voiced_threshold=float(spec.get("nsf_voiced_threshold", defaults.nsf_voiced_threshold)),
        upsample_rates=_int_tuple(spec.get("upsample_rates", defaults.upsample_rates)),
        upsample_kernel_sizes=_int_tuple(spec.get("upsample_kernel_sizes", defaults.upsample_kernel_sizes)),
        n_fft=int(istft["n_fft"]),
        istft_hop=int(istft["hop_len"]),
        resblock_kernel_sizes=_int_tuple(spec.get("resblock_kernel_sizes", defaults.resblock_kernel_sizes)),
        resblock_dilation_sizes=tuple(
            _int_tuple(d) for d in spec.get("resblock_dilation_sizes", defaults.resblock_dilation_sizes)
        ),
        source_resblock_kernel_sizes=_int_tuple(
            spec.get("source_resblock_kernel_sizes", defaults.source_resblock_kernel_sizes)
        ),
        source_resblock_dilation_sizes=tuple(
            _int_tuple(d) for d in spec.get("source_resblock_dilation_sizes", defaults.source_resblock_dilation_sizes)
        ),
        lrelu_slope=float(spec.get("lrelu_slope", defaults.lrelu_slope)),
        audio_limit=float(spec.get("audio_limit", defaults.audio_limit)),
    )


def _padding_mask(lengths: Tensor, size: int, dtype: torch.dtype) -> Tensor | None:
    """`time_mask`, or None when no item is padded: a batch of one skips the mask multiplies."""
    return None if bool((lengths >= size).all()) else time_mask(lengths, size, dtype)


def _get_padding(kernel_size: int, dilation: int) -> int:
    return (kernel_size * dilation - dilation) // 2


class Snake(nn.Module):
    """x + 1/alpha * sin^2(alpha * x), one alpha per channel; computed in fp32 (1/alpha overflows fp16)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, C, T] -> [B, C, T]"""
        alpha = self.alpha.float()[None, :, None]
        x32 = x.float()
        sine = torch.sin_(x32 * alpha)  # in place: the vocoder's widest tensors, one pass and buffer fewer
        # the official x + (1 / alpha) * sin^2, product and sum rounded apart (addcmul's fused rounding differs)
        return sine.mul_(sine).mul_(1.0 / (alpha + _SNAKE_EPS)).add_(x32).to(x.dtype)


class ResBlock(nn.Module):
    """HiFi-GAN/BigVGAN residual block: per dilation, Snake -> dilated conv -> Snake -> conv, plus skip."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(Conv1d(channels, channels, kernel_size, dilation=d, padding=_get_padding(kernel_size, d)))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(Conv1d(channels, channels, kernel_size, padding=_get_padding(kernel_size, 1)))
            for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """x: [B, C, T] (zero beyond each length), mask: [B, 1, T] or None (no padding) -> [B, C, T]"""
        for act1, conv1, act2, conv2 in zip(
            self.activations1, self.convs1, self.activations2, self.convs2, strict=True
        ):
            # Snake(0) = 0, so masking each conv output keeps every conv input zero-padded as when alone
            hidden = apply_mask(conv1(act1(x)), mask)
            # x + the branch, added into the branch's fresh tensor (the same sum, one buffer and pass fewer)
            x = apply_mask(conv2(act2(hidden)), mask).add_(x)
        return x


class ConvRNNF0Predictor(nn.Module):
    """f0 in Hz per mel frame: 5 x (conv k3 -> ELU), then a linear layer and abs."""

    def __init__(self, config: F0PredictorConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            in_channels = config.in_channels if i == 0 else config.cond_channels
            layers += [weight_norm(Conv1d(in_channels, config.cond_channels, kernel_size=3, padding=1)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = Linear(config.cond_channels, 1)

    def forward(self, mel: Tensor) -> Tensor:
        """mel: [B, in_channels, T] -> f0 [B, T] Hz, fp32"""
        return self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1).abs().float()


class SineDraws(NamedTuple):
    """The random draws of the v1 `SineGen`, in the official order."""

    phases: Tensor  # [B, harmonics + 1, 1], U(-pi, pi); the fundamental's (row 0) is replaced by 0
    noise: Tensor  # [B, harmonics + 1, L], N(0, 1)


class SineExcitation(nn.Module):
    """What the NSF sine sources share: the harmonics of f0, their amplitude, and the excitation of a phase."""

    def __init__(self, config: HiFTConfig) -> None:
        super().__init__()
        self.harmonics = config.nb_harmonics + 1
        self.sampling_rate = config.sampling_rate
        self.sine_amp = config.nsf_alpha
        self.noise_std = config.nsf_sigma
        self.voiced_threshold = config.nsf_voiced_threshold

    def excitation(self, phase: Tensor, f0: Tensor, noise: Tensor) -> Tensor:
        """phase [B, harmonics + 1, L] radians, f0 [B, L] Hz at the sample rate, noise [B, harmonics + 1, L]
        -> the sines where voiced, plus noise [B, harmonics + 1, L]."""
        sines = torch.sin(phase) * self.sine_amp
        voiced = (f0 > self.voiced_threshold).to(f0.dtype)[:, None, :]
        # unvoiced noise std sine_amp / 3 keeps its peaks near sine_amp
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        return sines * voiced + noise_amp * noise


class SineGen(SineExcitation):
    """v1 NSF sine source: harmonics of the sample-rate f0 with random initial phases, zeroed where unvoiced."""

    def draw(self, batch: int, length: int, device: torch.device, generator: torch.Generator | None) -> SineDraws:
        phases = torch.rand((batch, self.harmonics, 1), generator=generator, device=device) * (2 * math.pi) - math.pi
        noise = torch.randn((batch, self.harmonics, length), generator=generator, device=device)
        return SineDraws(phases, noise)

    def forward(self, f0: Tensor, draws: SineDraws) -> Tensor:
        """f0: [B, L] fp32 Hz at the sample rate -> sine waves + noise [B, harmonics + 1, L]"""
        multiples = torch.arange(1, self.harmonics + 1, device=f0.device, dtype=f0.dtype)[None, :, None]
        cycles = f0[:, None, :] * multiples / self.sampling_rate
        theta = 2 * math.pi * (torch.cumsum(cycles, dim=-1) % 1)
        phases = torch.cat([torch.zeros_like(draws.phases[:, :1]), draws.phases[:, 1:]], dim=1)
        return self.excitation(theta + phases, f0, draws.noise)


class Sine2Draws(NamedTuple):
    """The random draws of the v2 `SineGen2`, in the official order (its third draw is unused and not kept)."""

    initial_phase: Tensor  # [B, harmonics + 1] cycles, U(0, 1); the fundamental's (column 0) is replaced by 0
    noise: Tensor  # [B, L, harmonics + 1], N(0, 1)


class SineGen2(SineExcitation):
    """v2 NSF sine source: like `SineGen`, but the phase is integrated at the frame rate and linearly
    interpolated back to the sample rate, and the random initial phase enters only at the first sample.

    Padding: where f0 is 0 past an item's frames, the frame-rate phase stays constant there, which is exactly
    the edge value the linear up-interpolation of the item alone repeats; the down-interpolation only mixes the
    two middle samples of each frame. So with zero-padded f0 every item's samples equal its source alone.
    """

    def __init__(self, config: HiFTConfig) -> None:
        super().__init__(config)
        self.hop = config.hop

    def draw(self, batch: int, length: int, device: torch.device, generator: torch.Generator | None) -> Sine2Draws:
        initial_phase = torch.rand((batch, self.harmonics), generator=generator, device=device)
        noise = torch.randn((batch, length, self.harmonics), generator=generator, device=device)
        # the official source module then draws its unused noise branch; drawing it too keeps a seeded
        # generator in step with the official draw sequence
        torch.randn((batch, length, 1), generator=generator, device=device)
        return Sine2Draws(initial_phase, noise)

    def forward(self, f0: Tensor, draws: Sine2Draws) -> Tensor:
        """f0: [B, L] fp32 Hz at the sample rate, L a multiple of hop -> sine waves + noise [B, harmonics + 1, L]"""
        multiples = torch.arange(1, self.harmonics + 1, device=f0.device, dtype=f0.dtype)[None, :, None]
        cycles = (f0[:, None, :] * multiples / self.sampling_rate) % 1
        initial_phase = torch.cat([torch.zeros_like(draws.initial_phase[:, :1]), draws.initial_phase[:, 1:]], dim=1)
        cycles = torch.cat([cycles[:, :, :1] + initial_phase[:, :, None], cycles[:, :, 1:]], dim=-1)
        frame_cycles = F.interpolate(cycles, scale_factor=1 / self.hop, mode="linear")
        frame_phase = torch.cumsum(frame_cycles, dim=-1) * 2 * math.pi
        # a frame's phase advance spans hop samples, hence the scaling before the interpolation back
        phase = F.interpolate(frame_phase * self.hop, scale_factor=self.hop, mode="linear")
        return self.excitation(phase, f0, draws.noise.transpose(1, 2))


SourceDraws = SineDraws | Sine2Draws
# Source generators by the official class name.
_SINE_GENERATORS: dict[str, type[SineGen] | type[SineGen2]] = {"SineGen": SineGen, "SineGen2": SineGen2}


class SourceModuleHnNSF(nn.Module):
    """Harmonic-plus-noise source: the sine generator's channels merged by a linear layer and tanh."""

    def __init__(self, config: HiFTConfig) -> None:
        super().__init__()
        self.l_sin_gen = _SINE_GENERATORS[config.sine_generator](config)
        self.l_linear = Linear(config.nb_harmonics + 1, 1)

    def forward(self, f0: Tensor, draws: SourceDraws) -> Tensor:
        """f0: [B, L] fp32 Hz at the sample rate -> source [B, 1, L] fp32"""
        return self.merge(self.l_sin_gen(f0, draws))

    def merge(self, sines: Tensor) -> Tensor:
        """The sine generator's channels [B, harmonics + 1, L] -> source [B, 1, L] fp32 (linear layer, tanh)."""
        return torch.tanh(self.l_linear(sines.transpose(1, 2))).float().transpose(1, 2)


class HiFTGenerator(nn.Module):
    """HiFTNet generator (NSF + iSTFTNet), batch-first with per-item mel lengths.

    The layer classes and the convolutions that differ between generators come from the class attributes and the
    `_*_conv` methods, which the causal CosyVoice3 generator (engine.vocoder.causal_hift) overrides.
    """

    resblock_class: type[nn.Module] = ResBlock
    f0_predictor_class: type[nn.Module] = ConvRNNF0Predictor

    def __init__(self, config: HiFTConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        base, rates = config.base_channels, config.upsample_rates
        stage_channels = [base // 2 ** (i + 1) for i in range(len(rates))]
        spectrum_channels = config.n_fft + 2

        self.m_source = SourceModuleHnNSF(config)
        self.conv_pre = weight_norm(self._pre_conv(config.in_channels, base))
        self.ups = nn.ModuleList(
            weight_norm(self._upsample_conv(base // 2**i, channels, k, u))
            for i, (u, k, channels) in enumerate(zip(rates, config.upsample_kernel_sizes, stage_channels, strict=True))
        )
        # stage i mixes in the source spectrum downsampled by the product of the later upsample rates
        later_rates = [math.prod(rates[i + 1 :]) for i in range(len(rates))]
        self.source_downs = nn.ModuleList(
            self._source_down_conv(spectrum_channels, channels, rate)
            for rate, channels in zip(later_rates, stage_channels, strict=True)
        )
        self.source_resblocks = nn.ModuleList(
            self.resblock_class(channels, k, d)
            for channels, k, d in zip(
                stage_channels, config.source_resblock_kernel_sizes, config.source_resblock_dilation_sizes, strict=True
            )
        )
        self.resblocks = nn.ModuleList(
            self.resblock_class(channels, k, d)
            for channels in stage_channels
            for k, d in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = weight_norm(self._post_conv(stage_channels[-1], spectrum_channels))
        self.f0_predictor = self.f0_predictor_class(config.f0_predictor)
        # periodic Hann (scipy get_window('hann', n_fft, fftbins=True)); not in the checkpoint
        window = torch.hann_window(config.n_fft, periodic=True, dtype=torch.float64).float()
        self.register_buffer("stft_window", window, persistent=False)

    def _pre_conv(self, in_channels: int, out_channels: int) -> nn.Conv1d:
        """The mel input conv: k7, centred."""
        return Conv1d(in_channels, out_channels, 7, padding=3)

    def _upsample_conv(self, in_channels: int, out_channels: int, kernel_size: int, rate: int) -> nn.Module:
        """One upsampling stage: a transposed conv of stride `rate`."""
        return ConvTranspose1d(in_channels, out_channels, kernel_size, rate, padding=(kernel_size - rate) // 2)

    def _source_down_conv(self, in_channels: int, out_channels: int, rate: int) -> nn.Conv1d:
        """The source spectrum down to a stage's rate: k1, or k 2 rate with stride `rate`, centred."""
        if rate == 1:
            return Conv1d(in_channels, out_channels, 1)
        return Conv1d(in_channels, out_channels, rate * 2, rate, padding=rate // 2)

    def _post_conv(self, in_channels: int, out_channels: int) -> nn.Conv1d:
        """The conv to the magnitude and phase spectrum: k7, centred."""
        return Conv1d(in_channels, out_channels, 7, padding=3)

    @property
    def device(self) -> torch.device:
        return self.conv_pre.bias.device

    def load_official_state(self, state: dict[str, Tensor], source: str | Path) -> None:
        """Strictly load an official state dict; legacy `weight_g`/`weight_v` weight-norm keys are accepted."""
        load_strict(self, upgrade_legacy_weight_norm(state), source)

    def _weight_normed(self) -> list[nn.Module]:
        """The modules whose weight `fold_weight_norm` computes once."""
        return [m for m in self.modules() if parametrize.is_parametrized(m, "weight")]

    def fold_weight_norm(self) -> None:
        """For inference, after loading: replace each weight-norm parametrization by the plain weight g v / |v| it
        gives, computed once, instead of on every call (the same values: the outputs stay bit for bit). The module
        then no longer takes a checkpoint (its state-dict keys change), so load first."""
        with torch.no_grad():
            for module in self._weight_normed():
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)

    def _checked_lengths(self, mel: Tensor, lengths: Tensor | None) -> Tensor:
        if mel.dim() != 3 or mel.shape[1] != self.config.in_channels:
            raise InvalidInputError(f"mel must be [B, {self.config.in_channels}, T], got {tuple(mel.shape)}")
        batch, _, frames = mel.shape
        if lengths is None:
            return torch.full((batch,), frames, dtype=torch.long, device=mel.device)
        lengths = lengths.to(device=mel.device, dtype=torch.long)
        if lengths.shape != (batch,) or bool((lengths < 1).any()) or bool((lengths > frames).any()):
            raise InvalidInputError(f"mel lengths must be [{batch}] values in 1..{frames}, got {lengths.tolist()}")
        return lengths

    def predict_f0(self, mel: Tensor, lengths: Tensor | None = None) -> Tensor:
        """mel: [B, in_channels, T], lengths: [B] frames (default all T) -> f0 [B, T] Hz, fp32, 0 past lengths.

        Runs item by item (the predictor is tiny next to decode): the source phase integrates f0 over the
        whole utterance, so even the last-bit differences of a batched conv (whose algorithm depends on the
        batch size) would add up in the audio.
        """
        lengths = self._checked_lengths(mel, lengths)
        f0 = [self.f0_predictor(mel[i : i + 1, :, :frames])[0] for i, frames in enumerate(lengths.tolist())]
        return F.pad(nn.utils.rnn.pad_sequence(f0, batch_first=True), (0, mel.shape[-1] - int(lengths.max())))

    def sample_source_draws(self, batch: int, frames: int, generator: torch.Generator | None = None) -> SourceDraws:
        """The random draws of `make_source` for a [batch, frames] f0.

        From `generator` (which must live on the module's device), else from torch's global RNG.
        """
        return self.m_source.l_sin_gen.draw(batch, frames * self.config.hop, self.device, generator)

    def source_from_draws(self, f0: Tensor, draws: SourceDraws) -> Tensor:
        """f0: [B, T] Hz per frame, with given random draws -> source [B, 1, T*hop] fp32 (deterministic).

        With f0 zero past each item's frames (as `predict_f0` pads it), each item's samples equal its source alone.
        """
        f0_samples = f0.float().repeat_interleave(self.config.hop, dim=-1)  # the official nearest upsampling
        return self.m_source(f0_samples, draws)

    def make_source(self, f0: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """f0: [B, T] Hz per frame -> random NSF source [B, 1, T*hop] fp32.

        Padding after an item's frames leaves its samples unchanged (v1: the phase is a causal prefix sum; v2: as
        long as f0 is zero there, see `SineGen2`); the random draws are laid out for the whole [B, T] batch (use
        one call per item for per-item seeds).
        """
        return self.source_from_draws(f0, self.sample_source_draws(f0.shape[0], f0.shape[-1], generator))

    def _source_spectrum(self, source: Tensor, sample_lengths: Tensor, frames: int) -> Tensor:
        """source: [B, L] -> concat(real, imag) STFT [B, n_fft + 2, frames], zero past each item's frames.

        Equals torch.stft(center=True) of each item alone: the reflection padding is built per item at its own
        end instead of at the end of the padded batch.
        """
        pad = self.config.n_fft // 2
        positions = torch.arange(-pad, source.shape[-1] + pad, device=source.device).abs()[None, :]
        last = sample_lengths[:, None] - 1
        index = torch.where(positions > last, 2 * last - positions, positions).clamp(0, source.shape[-1] - 1)
        padded = source.float().gather(1, index)
        spectrum = torch.stft(
            padded,
            self.config.n_fft,
            self.config.istft_hop,
            window=self.stft_window.float(),
            center=False,
            return_complex=True,
        )
        spectrum_lengths = sample_lengths // self.config.istft_hop + 1
        return torch.cat([spectrum.real, spectrum.imag], dim=1) * time_mask(spectrum_lengths, frames, torch.float32)

    def _waveform(self, spectrum: Tensor, frame_lengths: Tensor) -> Tensor:
        """conv_post output [B, n_fft + 2, F] -> waveform [B, istft_hop * (F - 1)], fp32, clamped, 0 past lengths."""
        spectrum = spectrum.float()
        bins = self.config.n_fft // 2 + 1
        frame_mask = time_mask(frame_lengths, spectrum.shape[-1], torch.float32)
        magnitude = torch.exp(spectrum[:, :bins]) * frame_mask
        return self._istft(magnitude, torch.sin(spectrum[:, bins:]), frame_lengths)

    def _istft(self, magnitude: Tensor, phase: Tensor, frame_lengths: Tensor) -> Tensor:
        """The official `_istft(magnitude, phase)` (magnitude clipped at 100, then torch.istft(center=True)) of each
        item alone, written out so that the overlap-add normalisation counts only the item's own frames; then the
        clamp to +-audio_limit. magnitude (0 past each item's frames), phase: [B, n_fft/2 + 1, F] fp32
        -> [B, istft_hop * (F - 1)], 0 past lengths."""
        n_fft, hop = self.config.n_fft, self.config.istft_hop
        frames = magnitude.shape[-1]
        frame_mask = time_mask(frame_lengths, frames, torch.float32)
        magnitude = magnitude.clamp(max=_MAX_MAGNITUDE)
        window = self.stft_window.float()[None, :, None]
        segments = torch.fft.irfft(torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase)), n_fft, 1)
        fold = {"output_size": (1, n_fft + hop * (frames - 1)), "kernel_size": (1, n_fft), "stride": (1, hop)}
        overlap_added = F.fold(segments * window, **fold)[:, 0, 0]
        envelope = F.fold(window.pow(2) * frame_mask, **fold)[:, 0, 0]
        start = n_fft // 2
        samples = (overlap_added / envelope.clamp(min=1e-11))[:, start : start + hop * (frames - 1)]
        samples = samples.clamp(-self.config.audio_limit, self.config.audio_limit)
        return samples * time_mask(hop * (frame_lengths - 1), samples.shape[-1], torch.float32)[:, 0]

    def decode(self, mel: Tensor, source: Tensor, lengths: Tensor | None = None) -> Tensor:
        """mel: [B, in_channels, T], source: [B, 1, T*hop], lengths: [B] frames (default all T)
        -> waveform [B, T*hop] fp32, clamped to +-audio_limit, 0 past each item's lengths*hop samples.

        Streaming can overwrite the first samples of `source` with a cached source before calling this.
        """
        lengths = self._checked_lengths(mel, lengths)
        batch, _, frames = mel.shape
        if source.shape != (batch, 1, frames * self.config.hop):
            raise InvalidInputError(
                f"source must be [{batch}, 1, {frames * self.config.hop}], got {tuple(source.shape)}"
            )
        spectrum_frames = frames * self.config.hop // self.config.istft_hop + 1
        source_spectrum = self._source_spectrum(source[:, 0], lengths * self.config.hop, spectrum_frames)

        dtype = self.conv_pre.bias.dtype
        mask = _padding_mask(lengths, frames, dtype)
        x = apply_mask(self.conv_pre(apply_mask(mel, mask)), mask)
        stage_lengths = lengths
        kernels = len(self.config.resblock_kernel_sizes)
        for i, (up, rate) in enumerate(zip(self.ups, self.config.upsample_rates, strict=True)):
            x = up(F.leaky_relu(x, self.config.lrelu_slope))
            stage_lengths = stage_lengths * rate
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # the official ReflectionPad1d((1, 0))
                stage_lengths = stage_lengths + 1
            mask = _padding_mask(stage_lengths, x.shape[-1], dtype)
            x = apply_mask(x, mask)
            # the sums in place into fresh tensors, in the official order (a + b is b + a bit for bit)
            x = self.source_resblocks[i](apply_mask(self.source_downs[i](source_spectrum), mask), mask).add_(x)
            stage = self.resblocks[i * kernels : (i + 1) * kernels]
            total = stage[0](x, mask)
            for block in stage[1:]:
                total.add_(block(x, mask))
            x = total.div_(kernels)
        x = self.conv_post(F.leaky_relu(x, FINAL_LRELU_SLOPE))
        return self._waveform(x, stage_lengths)

    @torch.inference_mode()
    def inference(self, mels: list[Tensor], seeds: list[int | None] | None = None) -> list[Tensor]:
        """mels: each [in_channels, T_i]; seeds: one per mel (None: torch's global RNG) -> each waveform [T_i*hop].

        Each item's source is drawn from its own seed and decode masks the padding, so an item's audio does not
        depend on what it is batched with.
        """
        if seeds is None:
            seeds = [None] * len(mels)
        if len(seeds) != len(mels):
            raise InvalidInputError(f"got {len(seeds)} seeds for {len(mels)} mels")
        if not mels:
            return []
        for mel in mels:
            if mel.dim() != 2 or mel.shape[0] != self.config.in_channels or mel.shape[1] < 1:
                raise InvalidInputError(f"each mel must be [{self.config.in_channels}, T>0], got {tuple(mel.shape)}")
        device, hop = self.device, self.config.hop
        lengths = torch.tensor([mel.shape[1] for mel in mels], device=device)
        batch = nn.utils.rnn.pad_sequence([mel.to(device).T for mel in mels], batch_first=True).transpose(1, 2)
        f0 = self.predict_f0(batch, lengths)
        sources = []
        for i, (frames, seed) in enumerate(zip(lengths.tolist(), seeds, strict=True)):
            generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
            source = self.make_source(f0[i : i + 1, :frames], generator)
            sources.append(F.pad(source, (0, (batch.shape[-1] - frames) * hop)))
        speech = self.decode(batch, torch.cat(sources), lengths)
        return [speech[i, : frames * hop] for i, frames in enumerate(lengths.tolist())]


def upgrade_legacy_weight_norm(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename `torch.nn.utils.weight_norm` keys (`X.weight_g`, `X.weight_v`) to the parametrization keys."""
    renamed = {"weight_g": "parametrizations.weight.original0", "weight_v": "parametrizations.weight.original1"}
    upgraded = {}
    for key, value in state.items():
        prefix, _, leaf = key.rpartition(".")
        upgraded[f"{prefix}.{renamed[leaf]}" if leaf in renamed else key] = value
    return upgraded
