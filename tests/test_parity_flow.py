"""Numerical parity of the v1 flow with the official `MaskedDiffWithXvec.inference`, on every kit flow case."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import kit_group
from torch import Tensor

from engine.flow import FlowRequest, MaskedDiffWithXvec, mel_frames

HIDDEN_ATOL = 5e-5  # the kit README's acceptance for hidden tensors
FEAT_ATOL = 1e-4  # ... for the estimator output and the mel
T_SPAN_ATOL = 1e-7  # the float64 re-run deviates by 6.8e-8


@pytest.fixture(scope="module")
def flow_cases(kit_cases: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return kit_group(kit_cases, "flow")


def request_of(case: dict[str, Any]) -> FlowRequest:
    """The case's official call as a request, starting from the recorded noise."""
    return FlowRequest(
        tokens=case["token"][0],
        prompt_tokens=case["prompt_token"][0],
        prompt_feat=case["prompt_feat"][0],
        embedding=case["embedding"][0],
        noise=case["noise"][0],
    )


def assert_close(actual: Tensor, expected: Tensor, atol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = (actual.float() - expected).abs().max().item()
    assert error <= atol, f"{what}: max abs error {error:.3g} > {atol}"


def test_conditioning_matches(kit_flow: MaskedDiffWithXvec, flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        name = case["name"]
        conditioning = kit_flow.prepare([request_of(case)])
        assert conditioning.prompt_frames == [case["mel_len1"]], name
        assert conditioning.mel_lengths == [case["mel_len1"] + case["mel_len2"]], name
        assert mel_frames(case["token"].shape[1], kit_flow.config.input_frame_rate) == case["mel_len2"], name
        assert_close(conditioning.encoder_out, case["encoder_out"], HIDDEN_ATOL, f"{name} encoder_out")
        assert_close(conditioning.encoder_proj_out, case["encoder_proj_out"], HIDDEN_ATOL, f"{name} encoder_proj_out")
        assert_close(conditioning.mu, case["mu"], HIDDEN_ATOL, f"{name} mu")
        assert_close(conditioning.spks, case["spks"], HIDDEN_ATOL, f"{name} spks")
        assert_close(conditioning.cond, case["cond"], HIDDEN_ATOL, f"{name} cond")
        assert torch.equal(conditioning.mask, case["mask"]), name


def test_time_span_matches(kit_flow: MaskedDiffWithXvec, flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        assert_close(
            kit_flow.decoder.time_span(case["n_timesteps"]), case["t_span"], T_SPAN_ATOL, f"{case['name']} t_span"
        )


def test_estimator_step0_matches(kit_flow: MaskedDiffWithXvec, flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        inputs = [case[f"est_in_{k}"] for k in ("x", "mask", "mu", "t", "spks", "cond")]
        with torch.inference_mode():
            velocity = kit_flow.decoder.estimator(*inputs)
        assert_close(velocity, case["est_out_step0"], FEAT_ATOL, f"{case['name']} est_out_step0")


def test_cfm_feeds_the_estimator_the_official_cfg_batch(
    kit_flow: MaskedDiffWithXvec, flow_cases: list[dict[str, Any]]
) -> None:
    for case in flow_cases:
        calls: list[tuple[Tensor, ...]] = []
        hook = kit_flow.decoder.estimator.register_forward_pre_hook(lambda _, args, calls=calls: calls.append(args))
        try:
            kit_flow.inference([request_of(case)], n_timesteps=case["n_timesteps"])
        finally:
            hook.remove()
        assert len(calls) == case["num_estimator_calls"], case["name"]
        for field, value in zip(("x", "mask", "mu", "t", "spks", "cond"), calls[0], strict=True):
            assert_close(value, case[f"est_in_{field}"], HIDDEN_ATOL, f"{case['name']} est_in_{field}")


def test_feat_matches(kit_flow: MaskedDiffWithXvec, flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        (feat,) = kit_flow.inference([request_of(case)], n_timesteps=case["n_timesteps"])
        assert feat.dtype == torch.float32
        assert_close(feat, case["feat"][0], FEAT_ATOL, f"{case['name']} feat")


def test_flow_cache_matches(kit_flow: MaskedDiffWithXvec, flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        request = request_of(case)
        (cache,) = kit_flow.prepare([request]).flow_cache([request.noise])
        assert_close(cache, case["flow_cache_out"][0], HIDDEN_ATOL, f"{case['name']} flow_cache_out")
