"""Batching, seeding, low precision and loading errors of the v1 flow (`engine.flow.masked_diff`)."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from engine.errors import CheckpointError, InvalidInputError
from engine.flow.estimator import MaskedGroupNorm
from engine.flow.masked_diff import FlowConfig, FlowRequest, MaskedDiffWithXvec
from engine.loading.checkpoint import load_strict, read_state_dict
from engine.loading.yaml_config import ObjectSpec, load_model_yaml
from tests.parity.test_parity_flow import request_of

BATCH_ATOL = 1e-4  # a request inside a padded batch vs alone, fp32
LOW_PRECISION_RTOL = 0.05  # fp16/bf16 weights vs fp32: max error relative to the largest fp32 value


@pytest.fixture(scope="module")
def flow_yaml(conformance_kit: Path) -> ObjectSpec:
    return load_model_yaml(conformance_kit / "model" / "cosyvoice.yaml")["flow"]


@pytest.fixture(scope="module")
def requests(kit_cases: dict[str, list[dict[str, Any]]]) -> list[FlowRequest]:
    """Every kit flow case as a request with its recorded noise."""
    assert kit_cases["flow"], "the kit has no flow cases"
    return [request_of(case) for case in kit_cases["flow"]]


def max_error(actual: Tensor, expected: Tensor) -> float:
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    return (actual.float() - expected.float()).abs().max().item()


def assert_low_precision_close(flow: nn.Module, requests: list[FlowRequest], dtype: torch.dtype, **modes: bool) -> None:
    """A `dtype` copy of `flow` gives finite fp32 mels within LOW_PRECISION_RTOL of the fp32 ones."""
    low = copy.deepcopy(flow).to(dtype)
    assert all(p.dtype == dtype for p in low.parameters())
    pairs = zip(flow.inference(requests, **modes), low.inference(requests, **modes), strict=True)
    for index, (reference, feat) in enumerate(pairs):
        assert feat.dtype == torch.float32 and torch.isfinite(feat).all(), f"request {index}"
        scale = reference.abs().max().item()
        assert max_error(feat, reference) <= LOW_PRECISION_RTOL * scale, f"request {index}"


def test_batched_requests_equal_each_alone(kit_flow: MaskedDiffWithXvec, requests: list[FlowRequest]) -> None:
    # the kit cases (with and without prompts) plus a shorter prompt-free one drawn from a seed: mixed lengths
    base = requests[0]
    half = base.tokens[: max(1, len(base.tokens) // 2)]
    requests = [*requests, FlowRequest(half, base.tokens[:0], base.prompt_feat[:0], base.embedding, seed=3)]
    alone = [kit_flow.inference([r])[0] for r in requests]
    alone_mu = [kit_flow.prepare([r]).mu[0] for r in requests]
    assert len({a.shape[-1] for a in alone}) > 1

    for order in (list(range(len(requests))), list(reversed(range(len(requests))))):
        batch = [requests[i] for i in order]
        feats = kit_flow.inference(batch)
        conditioning = kit_flow.prepare(batch)
        for position, index in enumerate(order):
            assert max_error(feats[position], alone[index]) <= BATCH_ATOL, f"request {index} feat"
            length = conditioning.mel_lengths[position]
            mu = conditioning.mu[position, :, :length]
            assert max_error(mu, alone_mu[index]) <= BATCH_ATOL, f"request {index} mu"
            assert conditioning.mask[position, 0, length:].sum() == 0 and conditioning.mask[position, 0, :length].all()


def test_seed_makes_the_noise_reproducible(kit_flow: MaskedDiffWithXvec, requests: list[FlowRequest]) -> None:
    seeded = dataclasses.replace(requests[0], noise=None, seed=1234)
    first, again = kit_flow.inference([seeded])[0], kit_flow.inference([seeded])[0]
    assert torch.equal(first, again)
    other = kit_flow.inference([dataclasses.replace(seeded, seed=1235)])[0]
    assert max_error(first, other) > 1e-2

    (length,) = kit_flow.prepare([seeded]).mel_lengths
    (noise,) = kit_flow.start_noise([seeded], [length])
    assert torch.equal(
        noise, torch.randn(kit_flow.config.output_size, length, generator=torch.Generator().manual_seed(1234))
    )
    explicit = kit_flow.inference([dataclasses.replace(seeded, noise=noise, seed=None)])[0]
    assert torch.equal(first, explicit)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_run_and_stay_close(
    kit_flow: MaskedDiffWithXvec, requests: list[FlowRequest], dtype: torch.dtype
) -> None:
    assert_low_precision_close(kit_flow, requests, dtype)


def test_wrong_checkpoint_raises_checkpoint_error(
    kit_flow: MaskedDiffWithXvec, flow_yaml: ObjectSpec, conformance_kit: Path
) -> None:
    fresh = MaskedDiffWithXvec(FlowConfig.from_yaml(flow_yaml))
    hift_path = conformance_kit / "model" / "hift.pt"
    with pytest.raises(CheckpointError, match=re.escape(str(hift_path))):
        load_strict(fresh, read_state_dict(hift_path), hift_path)

    state = kit_flow.state_dict()
    dropped = {k: v for k, v in state.items() if k != "decoder.estimator.final_proj.bias"}
    with pytest.raises(CheckpointError, match=re.escape("missing keys: decoder.estimator.final_proj.bias")):
        load_strict(fresh, dropped, "dropped.pt")
    misshaped = {**state, "length_regulator.model.0.weight": torch.zeros(80, 80, 5)}
    with pytest.raises(CheckpointError, match=re.escape("mis-shaped keys: length_regulator.model.0.weight")):
        load_strict(fresh, misshaped, "misshaped.pt")


def with_node(spec: ObjectSpec, path: tuple[str, ...], value: Any) -> ObjectSpec:
    """A deep copy of `spec` with the node at `path` replaced (or its target, for the key 'target')."""
    changed = copy.deepcopy(spec)
    node = changed
    for key in path[:-1]:
        node = node[key]
    if path[-1] == "target":
        node.target = value
    else:
        node.kwargs[path[-1]] = value
    return changed


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("target",), "cosyvoice.flow.flow.CausalMaskedDiffWithXvec", "MaskedDiffWithXvec"),
        (("length_regulator", "target"), "x.OtherRegulator", "InterpolateRegulator"),
        (("decoder", "target"), "x.OtherCFM", "ConditionalCFM"),
        (("decoder", "estimator", "target"), "x.CausalConditionalDecoder", "ConditionalDecoder"),
        (("decoder", "estimator", "act_fn"), "snake", "act_fn"),
        (("decoder", "estimator", "in_channels"), 240, "in/out channels"),
    ],
)
def test_unsupported_config_raises_checkpoint_error(
    flow_yaml: ObjectSpec, path: tuple[str, ...], value: Any, message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        FlowConfig.from_yaml(with_node(flow_yaml, path, value))


def test_invalid_requests_raise_invalid_input_error(kit_flow: MaskedDiffWithXvec, requests: list[FlowRequest]) -> None:
    base = dataclasses.replace(requests[0], noise=None, seed=0)
    bad = [
        dataclasses.replace(base, tokens=base.tokens[:0]),
        dataclasses.replace(base, tokens=torch.tensor([kit_flow.config.vocab_size])),
        dataclasses.replace(base, prompt_tokens=torch.tensor([1, 2]), prompt_feat=torch.zeros(0, 80)),
        dataclasses.replace(base, prompt_tokens=torch.tensor([], dtype=torch.long), prompt_feat=torch.zeros(3, 80)),
        dataclasses.replace(base, embedding=torch.zeros(10)),
        dataclasses.replace(base, noise=torch.zeros(80, 1)),
    ]
    for request in bad:
        with pytest.raises(InvalidInputError):
            kit_flow.inference([request])
    assert kit_flow.inference([]) == []


def test_unpadded_fast_path_equals_the_masked_path(kit_flow: MaskedDiffWithXvec, kit_cases: dict[str, Any]) -> None:
    # an all-valid mask skips masking (mask None, F.group_norm, unbiased attention); the same frames followed by
    # masked padding take the masked path, and the valid frames must not notice the difference
    estimator = kit_flow.decoder.estimator
    x, mask, mu, t, spks, cond = (kit_cases["flow"][0][f"est_in_{k}"] for k in ("x", "mask", "mu", "t", "spks", "cond"))
    assert mask.all()
    frames, extra = x.shape[-1], 7

    def padded(tensor: Tensor) -> Tensor:
        return torch.nn.functional.pad(tensor, (0, extra))

    with torch.inference_mode():
        fast = estimator(x, mask, mu, t, spks, cond)
        masked = estimator(padded(x), padded(mask), padded(mu), t, spks, padded(cond))
    assert max_error(masked[..., :frames], fast) <= BATCH_ATOL
    assert masked[..., frames:].abs().max() == 0


def test_masked_group_norm_without_padding_equals_full_mask() -> None:
    norm = MaskedGroupNorm(4, 16)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(2, 16, 9)
    assert max_error(norm(x, None), norm(x, torch.ones(2, 1, 9))) <= 1e-5
