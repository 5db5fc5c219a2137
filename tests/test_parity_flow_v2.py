"""Numerical parity of the CosyVoice2 flow with the official `CausalMaskedDiffWithXvec.inference`, on every kit
flow case (non-streaming, and a streaming chunk with finalize=False)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import kit_group
from torch import Tensor

from engine.checkpoint import load_strict, read_state_dict
from engine.errors import CheckpointError
from engine.flow import ConditionalCFM, FlowRequest
from engine.flow_v2 import CausalFlowConfig, CausalMaskedDiffWithXvec
from engine.yaml_config import load_model_yaml

HIDDEN_ATOL = 5e-5  # the kit README's acceptance for encoder/mu/estimator tensors
FEAT_ATOL = 1e-4  # ... for the mel
T_SPAN_ATOL = 1e-7  # the float64 re-run deviates by 6.8e-8


@pytest.fixture(scope="module")
def flow_cases(v2_kit_cases: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return kit_group(v2_kit_cases, "flow")


def request_of(case: dict[str, Any]) -> FlowRequest:
    """The case's official call as a request (the noise is the model's fixed buffer, so none is given)."""
    return FlowRequest(
        tokens=case["token"][0],
        prompt_tokens=case["prompt_token"][0],
        prompt_feat=case["prompt_feat"][0],
        embedding=case["embedding"][0],
    )


def modes_of(case: dict[str, Any]) -> dict[str, bool]:
    return {"streaming": bool(case["streaming"]), "finalize": bool(case["finalize"])}


def assert_close(actual: Tensor, expected: Tensor, atol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = (actual.float() - expected).abs().max().item()
    assert error <= atol, f"{what}: max abs error {error:.3g} > {atol}"


def test_conditioning_matches(kit_flow_v2: CausalMaskedDiffWithXvec, flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        name = case["name"]
        conditioning = kit_flow_v2.prepare([request_of(case)], **modes_of(case))
        assert conditioning.prompt_frames == [case["mel_len1"]], name
        assert conditioning.mel_lengths == [case["mel_len1"] + case["mel_len2"]], name
        assert_close(conditioning.encoder_out, case["encoder_out"], HIDDEN_ATOL, f"{name} encoder_out")
        assert_close(conditioning.encoder_proj_out, case["encoder_proj_out"], HIDDEN_ATOL, f"{name} encoder_proj_out")
        assert_close(conditioning.mu, case["mu"], HIDDEN_ATOL, f"{name} mu")
        assert_close(conditioning.spks, case["spks"], HIDDEN_ATOL, f"{name} spks")
        assert_close(conditioning.cond, case["cond"], HIDDEN_ATOL, f"{name} cond")
        assert torch.equal(conditioning.mask, case["mask"]), name


def test_fixed_noise_and_time_span_match(
    kit_flow_v2: CausalMaskedDiffWithXvec, flow_cases: list[dict[str, Any]]
) -> None:
    for case in flow_cases:
        noise = case["noise"]
        assert torch.equal(kit_flow_v2.decoder.start_noise(noise.shape[-1]), noise), case["name"]
        t_span = ConditionalCFM.time_span(case["n_timesteps"])
        assert_close(t_span, case["t_span"], T_SPAN_ATOL, f"{case['name']} t_span")


def test_building_the_noise_leaves_the_global_rng_alone(v2_kit: Path) -> None:
    # the official code reseeds the global RNGs to build its noise; ours draws from a private generator
    decoder = CausalMaskedDiffWithXvec(kit_config(v2_kit)).decoder
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    assert decoder.start_noise(4).shape == (1, 80, 4)
    assert torch.equal(torch.rand(3), expected)


def kit_config(v2_kit: Path) -> CausalFlowConfig:
    return CausalFlowConfig.from_yaml(load_model_yaml(v2_kit / "model" / "cosyvoice2.yaml")["flow"])


def test_estimator_step0_matches(kit_flow_v2: CausalMaskedDiffWithXvec, flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        inputs = [case[f"est_in_{k}"] for k in ("x", "mask", "mu", "t", "spks", "cond")]
        with torch.inference_mode():
            velocity = kit_flow_v2.decoder.estimator(*inputs, streaming=bool(case["decoder_streaming"]))
        assert_close(velocity, case["est_out_step0"], HIDDEN_ATOL, f"{case['name']} est_out_step0")


def test_cfm_feeds_the_estimator_the_official_first_step(
    kit_flow_v2: CausalMaskedDiffWithXvec, flow_cases: list[dict[str, Any]]
) -> None:
    for case in flow_cases:
        calls: list[tuple[tuple[Tensor, ...], dict[str, Any]]] = []
        hook = kit_flow_v2.decoder.estimator.register_forward_pre_hook(
            lambda _, args, kwargs, calls=calls: calls.append((args, kwargs)), with_kwargs=True
        )
        try:
            kit_flow_v2.inference([request_of(case)], n_timesteps=case["n_timesteps"], **modes_of(case))
        finally:
            hook.remove()
        name = case["name"]
        assert len(calls) == case["num_estimator_calls"], name
        args, kwargs = calls[0]
        for key, actual in zip(("x", "mask", "mu", "t", "spks", "cond"), args, strict=True):
            assert_close(actual, case[f"est_in_{key}"], HIDDEN_ATOL, f"{name} est_in_{key}")
        assert kwargs["streaming"] == bool(case["decoder_streaming"]), name


def test_feat_matches(kit_flow_v2: CausalMaskedDiffWithXvec, flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        (feat,) = kit_flow_v2.inference([request_of(case)], n_timesteps=case["n_timesteps"], **modes_of(case))
        assert feat.dtype == torch.float32
        assert_close(feat, case["feat"][0], FEAT_ATOL, f"{case['name']} feat")


def test_strict_load_rejects_a_missing_or_an_extra_key(v2_kit: Path) -> None:
    path = v2_kit / "model" / "flow.pt"
    state = read_state_dict(path)
    model = CausalMaskedDiffWithXvec(kit_config(v2_kit))
    assert set(model.state_dict()) == set(state)  # the fixed noise is not a checkpoint entry
    missing = {k: v for k, v in state.items() if k != "encoder.pre_lookahead_layer.conv1.bias"}
    with pytest.raises(CheckpointError, match=re.escape("missing keys: encoder.pre_lookahead_layer.conv1.bias")):
        load_strict(model, missing, "missing.pt")
    with pytest.raises(CheckpointError, match=re.escape("unexpected keys: decoder.rand_noise")):
        load_strict(model, {**state, "decoder.rand_noise": torch.zeros(1, 80, 15000)}, "extra.pt")
