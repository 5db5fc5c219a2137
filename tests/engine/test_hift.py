"""engine.vocoder.hift behaviour: batching, seeds, low precision, checkpoint loading and config validation."""

from __future__ import annotations

import copy
import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils import parametrize

from engine.errors import CheckpointError, InvalidInputError
from engine.loading.checkpoint import read_state_dict
from engine.loading.loader import CHECKPOINT_FILES, load_module
from engine.loading.yaml_config import ObjectSpec, load_model_yaml
from engine.vocoder.causal_hift import CausalHiFTConfig, CausalHiFTGenerator
from engine.vocoder.hift import HiFTConfig, HiFTGenerator, Snake
from tests.conftest import v3_kit_cases, v3_kit_dir, v3_yaml

BATCH_ATOL = 1e-4
# fp32 garbage in the padded region: masking must keep it from reaching the real items
MEL_PAD_VALUE, SOURCE_PAD_VALUE = 3.0, 0.5


@pytest.fixture(scope="module")
def hift_spec(conformance_kit: Path) -> ObjectSpec:
    return load_model_yaml(conformance_kit / "model" / "cosyvoice.yaml")["hift"]


@pytest.fixture(scope="module")
def mixed_inputs(kit_cases: dict[str, list[dict[str, Any]]]) -> list[tuple[Tensor, Tensor]]:
    """(mel [80, T], source [1, T*hop]) of every kit case, plus a shortened first case so lengths always differ."""
    pairs = [(case["mel"][0], case["source"][0]) for case in kit_cases["hift"]]
    mel, source = pairs[0]
    frames = max(1, mel.shape[-1] // 3)
    pairs.append((mel[:, :frames], source[:, : source.shape[-1] * frames // mel.shape[-1]]))
    return pairs


def _pad_batch(pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    frames = max(mel.shape[-1] for mel, _ in pairs)
    samples = max(source.shape[-1] for _, source in pairs)
    mels = torch.stack([F.pad(mel, (0, frames - mel.shape[-1]), value=MEL_PAD_VALUE) for mel, _ in pairs])
    sources = torch.stack([F.pad(s, (0, samples - s.shape[-1]), value=SOURCE_PAD_VALUE) for _, s in pairs])
    return mels, sources, torch.tensor([mel.shape[-1] for mel, _ in pairs])


def _assert_batched_decode_matches_alone(model: HiFTGenerator, pairs: list[tuple[Tensor, Tensor]]) -> None:
    mels, sources, lengths = _pad_batch(pairs)
    assert len(set(lengths.tolist())) > 1
    with torch.inference_mode():
        batched = model.decode(mels, sources, lengths)
        for i, (mel, source) in enumerate(pairs):
            alone = model.decode(mel[None], source[None])[0]
            assert alone.shape == (mel.shape[-1] * model.config.hop,)
            assert (batched[i, : alone.shape[0]] - alone).abs().max() <= BATCH_ATOL
            assert torch.all(batched[i, alone.shape[0] :] == 0)


def test_batched_decode_and_f0_match_each_item_alone(
    kit_hift: HiFTGenerator, mixed_inputs: list[tuple[Tensor, Tensor]]
) -> None:
    _assert_batched_decode_matches_alone(kit_hift, mixed_inputs)
    mels, _, lengths = _pad_batch(mixed_inputs)
    with torch.inference_mode():
        batched = kit_hift.predict_f0(mels, lengths)
        for i, (mel, _) in enumerate(mixed_inputs):
            alone = kit_hift.predict_f0(mel[None])[0]
            torch.testing.assert_close(batched[i, : mel.shape[-1]], alone, rtol=1e-5, atol=1e-4)
            assert torch.all(batched[i, mel.shape[-1] :] == 0)


def test_batched_inference_matches_alone_and_seeds_reproduce(
    kit_hift: HiFTGenerator, mixed_inputs: list[tuple[Tensor, Tensor]]
) -> None:
    mels = [mel for mel, _ in mixed_inputs]
    seeds = list(range(len(mels)))
    batched = kit_hift.inference(mels, seeds)
    again = kit_hift.inference(mels[::-1], seeds[::-1])[::-1]
    for mel, seed, speech, repeated in zip(mels, seeds, batched, again, strict=True):
        alone = kit_hift.inference([mel], [seed])[0]
        assert speech.shape == (mel.shape[-1] * kit_hift.config.hop,)
        assert (speech - alone).abs().max() <= BATCH_ATOL
        assert torch.equal(speech, repeated)
        assert torch.isfinite(speech).all() and speech.abs().max() <= kit_hift.config.audio_limit
    reseeded = kit_hift.inference(mels, [seed + 1000 for seed in seeds])
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(batched, reseeded, strict=True))
    assert all(torch.isfinite(speech).all() for speech in kit_hift.inference(mels))  # global RNG
    assert kit_hift.inference([]) == []


def test_make_source_is_reproducible_per_generator(kit_hift: HiFTGenerator, kit_cases: dict[str, Any]) -> None:
    f0 = kit_cases["hift"][0]["f0"]
    with torch.inference_mode():
        first = kit_hift.make_source(f0, torch.Generator().manual_seed(7))
        second = kit_hift.make_source(f0, torch.Generator().manual_seed(7))
        other = kit_hift.make_source(f0, torch.Generator().manual_seed(8))
    assert first.shape == (f0.shape[0], 1, f0.shape[-1] * kit_hift.config.hop) and first.dtype == torch.float32
    assert torch.equal(first, second) and not torch.equal(first, other)
    assert first.abs().max() <= 1  # tanh output


def test_snake_stays_finite_with_a_tiny_alpha_in_fp16() -> None:
    snake = Snake(2)
    with torch.no_grad():
        snake.alpha.copy_(torch.tensor([1e-6, 1.0]))
    x = torch.linspace(-4, 4, 9).expand(1, 2, 9)
    expected = snake(x)
    out = snake.half()(x.half())
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(("dtype", "max_relative_error"), [(torch.float16, 0.03), (torch.bfloat16, 0.15)])
def test_low_precision_hift_is_finite_and_close_to_fp32(
    kit_hift: HiFTGenerator, mixed_inputs: list[tuple[Tensor, Tensor]], dtype: torch.dtype, max_relative_error: float
) -> None:
    reference = copy.deepcopy(kit_hift)
    with torch.no_grad():  # a tiny alpha: 1/alpha overflows fp16, Snake must stay finite
        reference.resblocks[0].activations1[0].alpha[0] = 1e-6
        reference.source_resblocks[0].activations2[1].alpha[-1] = 1e-6
    low = copy.deepcopy(reference).to(dtype)
    assert all(p.dtype == dtype for p in low.parameters())
    mels, sources, lengths = _pad_batch(mixed_inputs)
    with torch.inference_mode():
        expected = reference.decode(mels, sources, lengths)
        speech = low.decode(mels.to(dtype), sources, lengths)
        assert all(torch.isfinite(s).all() for s in low.inference([mel for mel, _ in mixed_inputs], [0] * len(mels)))
    assert speech.dtype == torch.float32 and torch.isfinite(speech).all()
    assert ((speech - expected).norm() / expected.norm()) <= max_relative_error
    clamped = (speech.abs() >= kit_hift.config.audio_limit).float().mean()
    assert clamped <= (expected.abs() >= kit_hift.config.audio_limit).float().mean() + 0.01  # no saturation


def test_legacy_weight_norm_keys_load(conformance_kit: Path, kit_hift: HiFTGenerator, hift_spec: ObjectSpec) -> None:
    official = read_state_dict(conformance_kit / "model" / "hift.pt")
    legacy = {
        key.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v"
        ): value
        for key, value in official.items()
    }
    assert any(key.endswith(".weight_g") for key in legacy) and any(key.endswith(".weight_v") for key in legacy)
    model = HiFTGenerator(HiFTConfig.from_yaml(hift_spec))
    model.load_official_state(legacy, "legacy_hift.pt")
    loaded = model.state_dict()
    assert loaded.keys() == official.keys()
    assert all(torch.equal(loaded[key], official[key]) for key in official)


def _weight_normed(model: HiFTGenerator) -> list[str]:
    return [name for name, m in model.named_modules() if parametrize.is_parametrized(m, "weight")]


def test_folded_weight_norm_gives_the_same_audio_bit_for_bit(
    conformance_kit: Path, hift_spec: ObjectSpec, mixed_inputs: list[tuple[Tensor, Tensor]]
) -> None:
    """The app's vocoder (`load_module`) has plain weights; one loaded but not folded gives the same samples."""
    official = read_state_dict(conformance_kit / "model" / "hift.pt")
    model = HiFTGenerator(HiFTConfig.from_yaml(hift_spec)).eval()
    model.load_official_state(official, "hift.pt")
    assert len(_weight_normed(model)) > 10
    mels = [mel for mel, _ in mixed_inputs]
    loaded = load_module(conformance_kit / "model", "hift")
    assert _weight_normed(loaded) == []
    seeds = [0] * len(mels)
    for ours, folded in zip(model.inference(mels, seeds), loaded.inference(mels, seeds), strict=True):
        assert torch.equal(ours, folded)
    with pytest.raises(CheckpointError, match="unexpected keys"):  # load first, then fold
        loaded.load_official_state(official, "hift.pt")


def test_folded_causal_vocoder_keeps_its_float64_f0_predictor() -> None:
    """v3: every weight norm but the f0 predictor's is folded (its weights are computed in float64 from g and v),
    and the audio is the same bit for bit."""
    kit = v3_kit_dir()
    model = load_module(kit / "model", "hift")
    assert isinstance(model, CausalHiFTGenerator)
    assert all(name.startswith("f0_predictor.") for name in _weight_normed(model)) and _weight_normed(model)
    unfolded = CausalHiFTGenerator(CausalHiFTConfig.from_yaml(v3_yaml(kit)["hift"])).eval()
    unfolded.load_official_state(read_state_dict(kit / "model" / "hift.pt"), "hift.pt")
    mels = [case["mel"][0] for case in v3_kit_cases(kit)["hift"][:2]]
    for ours, folded in zip(unfolded.inference(mels), model.inference(mels), strict=True):
        assert torch.equal(ours, folded)


def test_misshaped_or_incomplete_checkpoint_raises(
    conformance_kit: Path, hift_spec: ObjectSpec, tmp_path: Path
) -> None:
    official = read_state_dict(conformance_kit / "model" / "hift.pt")
    model = HiFTGenerator(HiFTConfig.from_yaml(hift_spec))
    misshaped = dict(official, **{"conv_post.bias": torch.zeros(official["conv_post.bias"].shape[0] + 1)})
    with pytest.raises(CheckpointError, match=r"conv_post\.bias"):
        model.load_official_state(misshaped, "hift.pt")
    incomplete = {k: v for k, v in official.items() if not k.startswith("f0_predictor.classifier")}
    with pytest.raises(CheckpointError, match=r"missing keys: f0_predictor\.classifier"):
        model.load_official_state(incomplete, "hift.pt")
    for name in ("cosyvoice.yaml", *CHECKPOINT_FILES):  # the kit's model dir, but for a mis-shaped hift.pt
        shutil.copy(conformance_kit / "model" / name, tmp_path / name)
    torch.save(misshaped, tmp_path / "hift.pt")
    with pytest.raises(CheckpointError, match=r"hift\.pt"):
        load_module(tmp_path, "hift")


def test_config_from_the_kit_yaml(hift_spec: ObjectSpec) -> None:
    config = HiFTConfig.from_yaml(hift_spec)
    assert config.upsample_rates == tuple(hift_spec["upsample_rates"])
    assert config.n_fft == hift_spec["istft_params"]["n_fft"]
    assert config.hop == config.istft_hop * torch.tensor(config.upsample_rates).prod().item()
    assert config.f0_predictor.cond_channels == hift_spec["f0_predictor"]["cond_channels"]


def _spec_with(spec: ObjectSpec, **changes: Any) -> ObjectSpec:
    return ObjectSpec(spec.target, {**spec.kwargs, **changes}, spec.call)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"upsample_rates": [8, 8, 2]}, "one entry per stage"),
        ({"fancy_option": 1}, "fancy_option"),
        ({"resblock_dilation_sizes": [[], [1, 3, 5], [1, 3, 5]]}, "at least one dilation"),
        ({"f0_predictor": ObjectSpec("cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor")}, "f0 predictor"),
    ],
)
def test_unsupported_configs_raise(hift_spec: ObjectSpec, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        HiFTConfig.from_yaml(_spec_with(hift_spec, **changes))


def test_unsupported_vocoder_class_raises(hift_spec: ObjectSpec) -> None:
    causal = ObjectSpec("cosyvoice.hifigan.generator.CausalHiFTGenerator", hift_spec.kwargs)
    with pytest.raises(CheckpointError, match="CausalHiFTGenerator"):
        HiFTConfig.from_yaml(causal)


def test_v2_shaped_hift_builds_and_batches(hift_spec: ObjectSpec) -> None:
    """Three stages with rates [8, 5, 3] (hop 480) as in CosyVoice2, random weights, the v1 source."""
    spec = _spec_with(
        hift_spec,
        upsample_rates=[8, 5, 3],
        upsample_kernel_sizes=[16, 11, 7],
        source_resblock_kernel_sizes=[7, 7, 11],
        source_resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    )
    torch.manual_seed(0)
    model = HiFTGenerator(HiFTConfig.from_yaml(spec)).eval()
    assert model.config.hop == 480
    assert [tuple(down.weight.shape) for down in model.source_downs] == [(16, 18, 30), (8, 18, 6), (4, 18, 1)]
    generator = torch.Generator().manual_seed(0)
    pairs = []
    for frames in (5, 9, 2):
        mel = torch.randn(80, frames, generator=generator)
        pairs.append((mel, torch.rand(1, frames * 480, generator=generator) * 0.2 - 0.1))
    _assert_batched_decode_matches_alone(model, pairs)


def test_invalid_inputs_raise(kit_hift: HiFTGenerator, mixed_inputs: list[tuple[Tensor, Tensor]]) -> None:
    mel, source = mixed_inputs[0]
    with torch.inference_mode():
        with pytest.raises(InvalidInputError, match="source"):
            kit_hift.decode(mel[None], source[None, :, :-1])
        with pytest.raises(InvalidInputError, match="lengths"):
            kit_hift.decode(mel[None], source[None], torch.tensor([mel.shape[-1] + 1]))
        with pytest.raises(InvalidInputError, match="mel"):
            kit_hift.predict_f0(mel[None, :-1])
        with pytest.raises(InvalidInputError, match="mel"):
            kit_hift.inference([mel[:, :0]])
        with pytest.raises(InvalidInputError, match="seeds"):
            kit_hift.inference([mel], [1, 2])


def test_config_is_frozen(kit_hift: HiFTGenerator) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        kit_hift.config.audio_limit = 1.0  # type: ignore[misc]
