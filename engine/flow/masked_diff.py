"""The CosyVoice v1 flow (`MaskedDiffWithXvec`): speech tokens -> 80-bin mel, batched over requests.

Tokens (prompt + target) are embedded and encoded by a rel-pos Conformer, projected to 80 channels,
stretched to mel frames by the length regulator (prompt and target interpolated separately), then a
conditional flow-matching ODE is integrated from noise with classifier-free guidance, using the U-Net
in `engine.flow.estimator` as the velocity field. Requests of any lengths share one padded batch; masks
keep each one identical to its own unbatched result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from engine.errors import InvalidInputError
from engine.flow.estimator import ConditionalDecoder, EstimatorConfig, MaskedGroupNorm
from engine.loading.yaml_config import ObjectSpec, expect_class, require
from engine.nn.conformer import EncoderConfig, RelPositionEncoder
from engine.nn.layers import Conv1d, Linear, length_mask

# v1 hard-codes the mel frame rate of 22050 Hz / hop 256 when converting token counts to frames
_MEL_SAMPLE_RATE = 22050
_MEL_HOP = 256
_HEAD_TAIL_TOKENS = 20  # long targets interpolate their first/last 20 tokens on their own
_FLOW_CACHE_TAIL_FRAMES = 34  # the official flow cache keeps the prompt frames plus the last 34 frames


def mel_frames(num_tokens: int, token_rate: int) -> int:
    """Mel frames for `num_tokens` speech tokens, with the official float operations and truncation."""
    return int(num_tokens / token_rate * _MEL_SAMPLE_RATE / _MEL_HOP)


def cfm_inference_cfg_rate(spec: ObjectSpec, class_name: str) -> float:
    """The CFG rate of a yaml `decoder` node of class `class_name` (every version's CFM), after checking its
    solver settings."""
    expect_class(spec, class_name, "flow decoder")
    params = spec["cfm_params"]
    if isinstance(params, ObjectSpec):  # `!new:omegaconf.DictConfig` wraps the values in `content`
        params = params.get("content", params.kwargs)
    solver, scheduler = params.get("solver", "euler"), params.get("t_scheduler", "cosine")
    require(solver == "euler", f"unsupported CFM solver {solver!r}; only 'euler' is implemented")
    require(scheduler == "cosine", f"unsupported CFM t_scheduler {scheduler!r}; only 'cosine' is implemented")
    return float(params.get("inference_cfg_rate", 0.7))


CFG_ROWS = 2  # classifier-free guidance runs the estimator on each request twice (with and without conditions)


def require_unet_io(estimator: Any, mel: int) -> None:
    """A U-Net estimator (v1, v2) takes x, mu, spks and cond of `mel` bins each, stacked, and gives a mel."""
    require(
        estimator.in_channels == 4 * mel and estimator.out_channels == mel,
        f"estimator in/out channels must be {4 * mel}/{mel} (x, mu, spks, cond of {mel} bins each)",
    )


def unet_activation_bytes(estimator: Any, width: int, frames: int, dtype_bytes: int) -> int:
    """Peak activations of a U-Net estimator (v1, v2) over `frames` mel frames, for the CFG pair: its stacked input
    and about four tensors of its widest level (`width` channels), and the attention scores in fp32."""
    hidden = CFG_ROWS * frames * (estimator.in_channels + 4 * width) * dtype_bytes
    attention = CFG_ROWS * estimator.num_heads * frames * frames * 4
    return hidden + attention


def target_frames(feat: Tensor, prompt_frames: list[int], mel_lengths: list[int]) -> list[Tensor]:
    """A batch's mel [B, mel, T] -> each request's frames past its prompt: [mel, mel_lengths[i] - prompt_frames[i]]."""
    spans = zip(prompt_frames, mel_lengths, strict=True)
    return [feat[index, :, start:end] for index, (start, end) in enumerate(spans)]


@dataclass(frozen=True)
class CFMConfig:
    inference_cfg_rate: float
    estimator: Any  # EstimatorConfig (v1 U-Net) or engine.flow.causal.CausalEstimatorConfig

    @classmethod
    def from_yaml(
        cls, spec: ObjectSpec, class_name: str = "ConditionalCFM", estimator: Any = EstimatorConfig
    ) -> CFMConfig:
        """From the yaml `decoder` node (class `class_name`, with `cfm_params` and an `estimator` node that
        `estimator.from_yaml` reads)."""
        return cls(
            inference_cfg_rate=cfm_inference_cfg_rate(spec, class_name),
            estimator=estimator.from_yaml(spec["estimator"]),
        )


@dataclass(frozen=True)
class FlowConfig:
    input_size: int  # token embedding width
    output_size: int  # mel bins
    spk_embed_dim: int
    vocab_size: int
    input_frame_rate: int  # speech tokens per second
    encoder: EncoderConfig
    regulator_convs: int  # Conv1d/GroupNorm/Mish stages of the length regulator
    regulator_groups: int
    decoder: CFMConfig

    @classmethod
    def from_yaml(cls, spec: ObjectSpec) -> FlowConfig:
        """From the yaml `flow` node (class `MaskedDiffWithXvec`)."""
        expect_class(spec, "MaskedDiffWithXvec", "flow")
        regulator = expect_class(spec["length_regulator"], "InterpolateRegulator", "length regulator")
        config = cls(
            input_size=int(spec["input_size"]),
            output_size=int(spec.get("output_size", 80)),
            spk_embed_dim=int(spec.get("spk_embed_dim", 192)),
            vocab_size=int(spec["vocab_size"]),
            input_frame_rate=int(spec.get("input_frame_rate", 50)),
            encoder=EncoderConfig.from_yaml(spec["encoder"], input_size=int(spec["input_size"])),
            regulator_convs=len(regulator.get("sampling_ratios", ())),
            regulator_groups=int(regulator.get("groups", 1)),
            decoder=CFMConfig.from_yaml(spec["decoder"]),
        )
        mel = config.output_size
        regulator_out = regulator.get("out_channels") or regulator["channels"]
        require(
            regulator["channels"] == mel and regulator_out == mel,
            f"length regulator channels must equal the flow output_size {mel}",
        )
        require_unet_io(config.decoder.estimator, mel)
        return config

    def mel_frames_of(self, speech_tokens: int) -> int:
        """Mel frames the flow makes from `speech_tokens` tokens."""
        return mel_frames(speech_tokens, self.input_frame_rate)

    def activation_bytes(self, frames: int, dtype_bytes: int) -> int:
        """Peak bytes of the flow's activations over `frames` mel frames (its estimator's)."""
        estimator = self.decoder.estimator
        return unet_activation_bytes(estimator, max(estimator.channels), frames, dtype_bytes)


@dataclass
class FlowRequest:
    tokens: Tensor  # [T] speech tokens to synthesise
    prompt_tokens: Tensor  # [P] speech tokens of the prompt (may be empty)
    prompt_feat: Tensor  # [Tp, 80] prompt mel (empty exactly when prompt_tokens is)
    embedding: Tensor  # [192] speaker x-vector
    noise: Tensor | None = None  # [80, Tp + T_mel] ODE start; drawn from `seed` when None
    seed: int | None = None  # None: the global torch RNG


def check_flow_request(request: FlowRequest, vocab_size: int, mel_bins: int, spk_embed_dim: int) -> None:
    """The checks of a request's tensors that both flows (v1 and v2) make; InvalidInputError on the first failure."""
    for name in ("tokens", "prompt_tokens"):
        tokens = getattr(request, name)
        if tokens.dim() != 1 or tokens.is_floating_point():
            raise InvalidInputError(f"{name} must be a 1-D integer tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        if tokens.numel() and int(tokens.max()) >= vocab_size:
            raise InvalidInputError(f"{name} holds ids >= the flow vocabulary size {vocab_size}")
    prompt_feat = request.prompt_feat
    if prompt_feat.dim() != 2 or prompt_feat.shape[1] != mel_bins:
        raise InvalidInputError(f"prompt_feat must be [frames, {mel_bins}], got {tuple(prompt_feat.shape)}")
    if (prompt_feat.shape[0] == 0) != (request.prompt_tokens.numel() == 0):
        raise InvalidInputError("prompt_tokens and prompt_feat must be both empty or both non-empty")
    if request.embedding.numel() != spk_embed_dim:
        raise InvalidInputError(f"embedding must have {spk_embed_dim} values, got {request.embedding.numel()}")


@dataclass
class FlowConditioning:
    """Everything the CFM is conditioned on, for a padded batch (mel frames include the prompt frames)."""

    encoder_out: Tensor  # [B, T_tok, D_enc] Conformer output, padded past token_lengths
    encoder_proj_out: Tensor  # [B, T_tok, 80]
    token_lengths: Tensor  # [B] prompt + target tokens
    mu: Tensor  # [B, 80, T_mel] length-regulated encoder output
    spks: Tensor  # [B, 80] projected speaker embedding
    cond: Tensor  # [B, 80, T_mel] prompt mel in the first prompt frames, zeros after
    mask: Tensor  # [B, 1, T_mel] 1 on valid frames
    prompt_frames: list[int]  # official mel_len1 per request
    mel_lengths: list[int]  # mel_len1 + mel_len2 per request

    def flow_cache(self, noise: list[Tensor]) -> list[Tensor]:
        """Official v1 `flow_cache` per request: [80, prompt + last 34 frames, 2] of (start noise, mu)."""
        caches = []
        for index, (start, prompt, length) in enumerate(zip(noise, self.prompt_frames, self.mel_lengths, strict=True)):
            kept = [start.to(self.mu.device, self.mu.dtype), self.mu[index, :, :length]]  # noise is drawn on the CPU
            tail = max(length - _FLOW_CACHE_TAIL_FRAMES, 0)
            caches.append(torch.stack([torch.cat([t[:, :prompt], t[:, tail:]], dim=1) for t in kept], dim=-1))
        return caches


def embed_flow_tokens(embedding: nn.Embedding, requests: list[FlowRequest]) -> tuple[Tensor, Tensor, Tensor]:
    """Prompt + target tokens of each request, embedded and right-padded (every flow version's first step)
    -> (embedded [B, T, D] zero past each row, token lengths [B], valid [B, T] bool)."""
    device, dtype = embedding.weight.device, embedding.weight.dtype
    tokens = [torch.cat([r.prompt_tokens, r.tokens]).to(device=device, dtype=torch.long) for r in requests]
    token_lengths = torch.tensor([len(t) for t in tokens], device=device)
    padded = pad_sequence(tokens, batch_first=True)
    valid = length_mask(token_lengths, padded.shape[1])
    return embedding(padded.clamp(min=0)) * valid.unsqueeze(-1).to(dtype), token_lengths, valid


def speaker_vectors(affine: nn.Module, requests: list[FlowRequest]) -> Tensor:
    """The L2-normalized x-vectors through the flow's `spk_embed_affine_layer` -> [B, mel]."""
    weight = affine.weight
    embeddings = torch.stack([r.embedding.reshape(-1) for r in requests]).to(device=weight.device, dtype=torch.float32)
    return affine(F.normalize(embeddings, dim=1))


def prompt_condition(requests: list[FlowRequest], like: Tensor, mel_bins: int) -> Tensor:
    """`cond` [B, mel_bins, T] in `like`'s dtype and device ([B, *, T]): each prompt mel in its first frames, zeros
    after."""
    cond = torch.zeros(like.shape[0], mel_bins, like.shape[2], device=like.device, dtype=like.dtype)
    for index, request in enumerate(requests):
        cond[index, :, : request.prompt_feat.shape[0]] = request.prompt_feat.t().to(cond)
    return cond


class InterpolateRegulator(nn.Module):
    """Stretches encoder frames to mel frames by linear interpolation, then refines them with a conv stack."""

    def __init__(self, channels: int, num_convs: int, groups: int) -> None:
        super().__init__()
        stages: list[nn.Module] = []
        for _ in range(num_convs):
            stages += [Conv1d(channels, channels, 3, 1, 1), MaskedGroupNorm(groups, channels), nn.Mish()]
        self.model = nn.Sequential(*stages, Conv1d(channels, channels, 1, 1))

    @staticmethod
    def stretch(prompt: Tensor, target: Tensor, prompt_frames: int, target_frames: int, token_rate: int) -> Tensor:
        """One request: prompt [P, C] and target [T, C] encodings -> [C, prompt_frames + target_frames].

        The parts are interpolated separately so the prompt/target boundary falls on a frame boundary;
        a long target also has its first and last 20 tokens interpolated on their own.
        """

        def interpolate(h: Tensor, frames: int) -> Tensor:
            return F.interpolate(h.t().unsqueeze(0), size=frames, mode="linear", align_corners=False)[0]

        edge_frames = mel_frames(_HEAD_TAIL_TOKENS, token_rate)
        if target.shape[0] > 2 * _HEAD_TAIL_TOKENS:
            head, middle, tail = (
                target[:_HEAD_TAIL_TOKENS],
                target[_HEAD_TAIL_TOKENS:-_HEAD_TAIL_TOKENS],
                target[-_HEAD_TAIL_TOKENS:],
            )
            parts = [(head, edge_frames), (middle, target_frames - 2 * edge_frames), (tail, edge_frames)]
        else:
            parts = [(target, target_frames)]
        if prompt.shape[0] > 0:
            parts.insert(0, (prompt, prompt_frames))
        return torch.cat([interpolate(h, frames) for h, frames in parts], dim=1)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x: [B, C, T] stretched encodings, mask: [B, 1, T] -> [B, C, T], zero on padded frames."""
        *stages, projection = self.model
        for conv, norm, act in zip(stages[0::3], stages[1::3], stages[2::3], strict=True):
            x = act(norm(conv(x * mask), mask))
        return projection(x * mask) * mask


class ConditionalCFM(nn.Module):
    """Euler integration of the flow-matching ODE with classifier-free guidance (every flow version's solver)."""

    def __init__(self, inference_cfg_rate: float, estimator: nn.Module) -> None:
        """`estimator(x, mask, mu, t, spks, cond, **options)` is the velocity field (v1/v2 U-Net, v3 DiT)."""
        super().__init__()
        self.inference_cfg_rate = inference_cfg_rate
        self.estimator = estimator

    @staticmethod
    def time_span(n_timesteps: int, device: torch.device | None = None) -> Tensor:
        """The cosine schedule t = 1 - cos(linspace(0, 1, n + 1) pi / 2), fp32 [n_timesteps + 1]."""
        linear = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=torch.float32)
        return 1 - torch.cos(linear * 0.5 * torch.pi)

    def forward(
        self,
        noise: Tensor,
        mu: Tensor,
        mask: Tensor,
        spks: Tensor,
        cond: Tensor,
        n_timesteps: int = 10,
        **estimator_options: bool,
    ) -> Tensor:
        """Integrate from `noise` at t=0 to the mel at t=1; `estimator_options` go to every estimator call.

        noise, cond: [B, 80, T]; mu: [B, C_mu, T]; mask: [B, 1, T]; spks: [B, 80] -> [B, 80, T] fp32 (the ODE
        state is fp32).
        """
        batch = noise.shape[0]
        # one estimator call per step on 2B rows: the conditional rows, then the same x with mu = spks = cond = 0
        mask_in = torch.cat([mask, mask])
        mu_in, spks_in, cond_in = (torch.cat([c, torch.zeros_like(c)]) for c in (mu, spks, cond))
        rate = self.inference_cfg_rate
        t_span = self.time_span(n_timesteps, noise.device)
        x = noise.float()
        # t is accumulated by adding dt in fp32 and dt re-derived from it, as the official solver does
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, n_timesteps + 1):
            velocity = self.estimator(
                torch.cat([x, x]), mask_in, mu_in, t.expand(2 * batch), spks_in, cond_in, **estimator_options
            )
            conditional, unconditional = velocity.float().split(batch)
            x = x + dt * ((1.0 + rate) * conditional - rate * unconditional)
            t = t + dt
            if step < n_timesteps:
                dt = t_span[step + 1] - t
        return x


class MaskedDiffWithXvec(nn.Module):
    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        self.config = config
        mel = config.output_size
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = Linear(config.spk_embed_dim, mel)
        self.encoder = RelPositionEncoder(config.encoder)
        self.encoder_proj = Linear(config.encoder.output_size, mel)
        self.length_regulator = InterpolateRegulator(mel, config.regulator_convs, config.regulator_groups)
        self.decoder = ConditionalCFM(config.decoder.inference_cfg_rate, ConditionalDecoder(config.decoder.estimator))

    def _validate(self, request: FlowRequest) -> None:
        check_flow_request(request, self.config.vocab_size, self.config.output_size, self.config.spk_embed_dim)
        if request.tokens.numel() == 0:
            raise InvalidInputError("tokens must not be empty")

    @torch.inference_mode()
    def prepare(self, requests: list[FlowRequest]) -> FlowConditioning:
        """Encode and length-regulate a batch of requests into the CFM conditioning (see FlowConditioning)."""
        if not requests:
            raise InvalidInputError("the flow needs at least one request")
        for request in requests:
            self._validate(request)
        weight = self.input_embedding.weight
        device, dtype = weight.device, weight.dtype
        rate = self.config.input_frame_rate

        embedded, token_lengths, _ = embed_flow_tokens(self.input_embedding, requests)
        encoder_out = self.encoder(embedded, token_lengths)
        encoder_proj_out = self.encoder_proj(encoder_out)

        prompt_frames = [r.prompt_feat.shape[0] for r in requests]
        stretched = []
        for index, (request, prompt) in enumerate(zip(requests, prompt_frames, strict=True)):
            split = request.prompt_tokens.numel()
            h = encoder_proj_out[index, : token_lengths[index]]
            target = mel_frames(request.tokens.numel(), rate)
            stretched.append(self.length_regulator.stretch(h[:split], h[split:], prompt, target, rate).t())
        mel_lengths = [s.shape[0] for s in stretched]
        mel_mask = length_mask(torch.tensor(mel_lengths, device=device), max(mel_lengths)).unsqueeze(1).to(dtype)
        mu = self.length_regulator(pad_sequence(stretched, batch_first=True).transpose(1, 2), mel_mask)

        return FlowConditioning(
            encoder_out=encoder_out,
            encoder_proj_out=encoder_proj_out,
            token_lengths=token_lengths,
            mu=mu,
            spks=speaker_vectors(self.spk_embed_affine_layer, requests),
            cond=prompt_condition(requests, mu, self.config.output_size),
            mask=mel_mask,
            prompt_frames=prompt_frames,
            mel_lengths=mel_lengths,
        )

    def start_noise(self, requests: list[FlowRequest], mel_lengths: list[int]) -> list[Tensor]:
        """The ODE start per request, fp32 [80, mel_length]: the given noise, or a draw seeded by `seed`.

        Drawn on CPU so that a seed gives the same noise on every device and dtype.
        """
        noise = []
        for request, length in zip(requests, mel_lengths, strict=True):
            shape = (self.config.output_size, length)
            if request.noise is None:
                generator = None if request.seed is None else torch.Generator().manual_seed(request.seed)
                noise.append(torch.randn(shape, generator=generator))
            elif tuple(request.noise.shape) != shape:
                raise InvalidInputError(f"noise must be {list(shape)}, got {list(request.noise.shape)}")
            else:
                noise.append(request.noise.float())
        return noise

    @torch.inference_mode()
    def inference(self, requests: list[FlowRequest], n_timesteps: int = 10) -> list[Tensor]:
        """Mel of each request's target tokens (prompt frames removed): fp32 [80, mel_frames(len(tokens))]."""
        if not requests:
            return []
        conditioning = self.prepare(requests)
        noise = self.start_noise(requests, conditioning.mel_lengths)
        device = conditioning.mu.device
        padded_noise = pad_sequence([n.t() for n in noise], batch_first=True).transpose(1, 2).to(device)
        feat = self.decoder(
            padded_noise, conditioning.mu, conditioning.mask, conditioning.spks, conditioning.cond, n_timesteps
        )
        return target_frames(feat, conditioning.prompt_frames, conditioning.mel_lengths)
