"""Numerical parity of the v1 flow (`MaskedDiffWithXvec`) and the CosyVoice2 causal flow (`CausalMaskedDiffWithXvec`,
non-streaming and a streaming chunk with finalize=False) with the official `inference`, on every flow case of the
v1 and v2 kits. What only v2 has: test_parity_flow_v2.py; CosyVoice3's DiT flow: test_parity_flow_v3.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from engine.flow.masked_diff import ConditionalCFM, FlowRequest, MaskedDiffWithXvec, mel_frames
from engine.loading.loader import load_module
from tests.conftest import kit_group, kit_model_version

HIDDEN_ATOL = 5e-5  # the kit README's acceptance for hidden tensors
FEAT_ATOL = 1e-4  # ... for the mel (and v1's estimator output)
ESTIMATOR_ATOL = {1: FEAT_ATOL, 2: HIDDEN_ATOL}
T_SPAN_ATOL = 1e-7  # the float64 re-run deviates by 6.8e-8
ESTIMATOR_INPUTS = ("x", "mask", "mu", "t", "spks", "cond")


def request_of(case: dict[str, Any]) -> FlowRequest:
    """The case's official call as a request, starting from the recorded noise where the kit has one (v1; the
    causal flows ignore it: theirs is fixed)."""
    return FlowRequest(
        tokens=case["token"][0],
        prompt_tokens=case["prompt_token"][0],
        prompt_feat=case["prompt_feat"][0],
        embedding=case["embedding"][0],
        noise=case["noise"][0] if "noise" in case else None,
    )


def modes_of(case: dict[str, Any]) -> dict[str, bool]:
    """The causal flows' `streaming` and `finalize` of the case (none for v1)."""
    return {"streaming": bool(case["streaming"]), "finalize": bool(case["finalize"])} if "streaming" in case else {}


def estimator_options(case: dict[str, Any]) -> dict[str, bool]:
    """What the CFM passes its estimator besides the tensors (the causal U-Net's chunked attention)."""
    return {"streaming": bool(case["decoder_streaming"])} if "decoder_streaming" in case else {}


def assert_close(actual: Tensor, expected: Tensor, atol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = (actual.float() - expected).abs().max().item()
    assert error <= atol, f"{what}: max abs error {error:.3g} > {atol}"


@pytest.fixture(scope="module")
def kit(v1_v2_kit: Path) -> Path:
    return v1_v2_kit


@pytest.fixture(scope="module")
def flow(kit: Path) -> nn.Module:
    """The kit's flow, of its family's class, strictly loaded from flow.pt through the loader."""
    return load_module(kit / "model", "flow")


@pytest.fixture(scope="module")
def flow_cases(kit: Path) -> list[dict[str, Any]]:
    return kit_group(torch.load(kit / "cases.pt", weights_only=True), "flow")


def test_conditioning_matches(flow: nn.Module, flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        name = case["name"]
        conditioning = flow.prepare([request_of(case)], **modes_of(case))
        assert conditioning.prompt_frames == [case["mel_len1"]], name
        assert conditioning.mel_lengths == [case["mel_len1"] + case["mel_len2"]], name
        if isinstance(flow, MaskedDiffWithXvec):  # v1 interpolates tokens to frames with the official rounding
            assert mel_frames(case["token"].shape[1], flow.config.input_frame_rate) == case["mel_len2"], name
        assert_close(conditioning.encoder_out, case["encoder_out"], HIDDEN_ATOL, f"{name} encoder_out")
        assert_close(conditioning.encoder_proj_out, case["encoder_proj_out"], HIDDEN_ATOL, f"{name} encoder_proj_out")
        assert_close(conditioning.mu, case["mu"], HIDDEN_ATOL, f"{name} mu")
        assert_close(conditioning.spks, case["spks"], HIDDEN_ATOL, f"{name} spks")
        assert_close(conditioning.cond, case["cond"], HIDDEN_ATOL, f"{name} cond")
        assert torch.equal(conditioning.mask, case["mask"]), name


def test_time_span_matches(flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        t_span = ConditionalCFM.time_span(case["n_timesteps"])
        assert_close(t_span, case["t_span"], T_SPAN_ATOL, f"{case['name']} t_span")


def test_estimator_step0_matches(flow: nn.Module, flow_cases: list[dict[str, Any]], kit: Path) -> None:
    for case in flow_cases:
        inputs = [case[f"est_in_{k}"] for k in ESTIMATOR_INPUTS]
        with torch.inference_mode():
            velocity = flow.decoder.estimator(*inputs, **estimator_options(case))
        atol = ESTIMATOR_ATOL[kit_model_version(kit)]
        assert_close(velocity, case["est_out_step0"], atol, f"{case['name']} est_out_step0")


def test_cfm_feeds_the_estimator_the_official_first_step(flow: nn.Module, flow_cases: list[dict[str, Any]]) -> None:
    """The first estimator call gets the official CFG batch (conditional and unconditional rows)."""
    for case in flow_cases:
        calls: list[tuple[tuple[Tensor, ...], dict[str, Any]]] = []
        hook = flow.decoder.estimator.register_forward_pre_hook(
            lambda _, args, kwargs, calls=calls: calls.append((args, kwargs)), with_kwargs=True
        )
        try:
            flow.inference([request_of(case)], n_timesteps=case["n_timesteps"], **modes_of(case))
        finally:
            hook.remove()
        name = case["name"]
        assert len(calls) == case["num_estimator_calls"], name
        args, kwargs = calls[0]
        for key, actual in zip(ESTIMATOR_INPUTS, args, strict=True):
            assert_close(actual, case[f"est_in_{key}"], HIDDEN_ATOL, f"{name} est_in_{key}")
        assert kwargs == estimator_options(case), name


def test_feat_matches(flow: nn.Module, flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        (feat,) = flow.inference([request_of(case)], n_timesteps=case["n_timesteps"], **modes_of(case))
        assert feat.dtype == torch.float32
        assert_close(feat, case["feat"][0], FEAT_ATOL, f"{case['name']} feat")


def test_v1_flow_cache_matches(kit_flow: MaskedDiffWithXvec, kit_cases: dict[str, list[dict[str, Any]]]) -> None:
    for case in kit_group(kit_cases, "flow"):
        request = request_of(case)
        (cache,) = kit_flow.prepare([request]).flow_cache([request.noise])
        assert_close(cache, case["flow_cache_out"][0], HIDDEN_ATOL, f"{case['name']} flow_cache_out")
