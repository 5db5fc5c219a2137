"""Parity of the CosyVoice3 flow (`CausalMaskedDiffWithDiT`, DiT estimator) with the official one, on the v3 kit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import CheckpointError, InvalidInputError
from engine.flow.dit import CausalMaskedDiffWithDiT, DiTFlowConfig
from tests.conftest import strictly_loaded, v3_kit_cases, v3_kit_dir, v3_yaml
from tests.parity.test_parity_flow import request_of  # the same case fields in every kit

ATOL = 1e-4  # feat, the estimator output and the conditioning (all within a few 1e-6 on the tiny kit)
BATCH_ATOL = 1e-5


@pytest.fixture(scope="module")
def kit() -> Path:
    return v3_kit_dir()


@pytest.fixture(scope="module")
def flow_cases(kit: Path) -> list[dict[str, Any]]:
    cases = v3_kit_cases(kit)["flow"]
    assert cases, "the kit has no flow cases"
    return cases


@pytest.fixture(scope="module")
def flow(kit: Path) -> CausalMaskedDiffWithDiT:
    return strictly_loaded(CausalMaskedDiffWithDiT(DiTFlowConfig.from_yaml(v3_yaml(kit)["flow"])), kit, "flow")


def test_conditioning(flow: CausalMaskedDiffWithDiT, flow_cases: list[dict[str, Any]]) -> None:
    """Row 0 of the recorded CFG batch is the conditional input: mu, the speaker vector and the prompt mel."""
    for case in flow_cases:
        conditioning = flow.prepare([request_of(case)], finalize=bool(case["finalize"]))
        name = case["name"]
        torch.testing.assert_close(conditioning.lookahead_out, case["lookahead_out"], atol=ATOL, rtol=0, msg=name)
        for ours, key in ((conditioning.mu, "est_in_mu"), (conditioning.spks, "est_in_spks")):
            torch.testing.assert_close(ours[0], case[key][0], atol=ATOL, rtol=0, msg=f"{name} {key}")
        torch.testing.assert_close(conditioning.cond[0], case["est_in_cond"][0], atol=0, rtol=0, msg=name)
        assert conditioning.prompt_frames == [case["mel_len1"]], name
        assert conditioning.mel_lengths == [case["mel_len1"] + case["mel_len2"]], name


def test_estimator_first_step(flow: CausalMaskedDiffWithDiT, flow_cases: list[dict[str, Any]]) -> None:
    """The DiT on the recorded inputs of the first Euler step (conditional and unconditional rows)."""
    for case in flow_cases:
        inputs = [case[f"est_in_{key}"] for key in ("x", "mask", "mu", "t", "spks", "cond")]
        with torch.inference_mode():
            velocity = flow.decoder.estimator(*inputs, streaming=bool(case["streaming"]))
        torch.testing.assert_close(velocity, case["est_out_step0"], atol=ATOL, rtol=0, msg=case["name"])


def test_feat(flow: CausalMaskedDiffWithDiT, flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        (feat,) = flow.inference([request_of(case)], streaming=bool(case["streaming"]), finalize=bool(case["finalize"]))
        assert case["num_estimator_calls"] == 10, case["name"]
        torch.testing.assert_close(feat, case["feat"][0], atol=ATOL, rtol=0, msg=case["name"])


def test_batched_feat_equals_alone(flow: CausalMaskedDiffWithDiT, flow_cases: list[dict[str, Any]]) -> None:
    """Requests of different lengths (and with the same mode) share one padded batch without changing their mel."""
    for mode in {(case["streaming"], case["finalize"]) for case in flow_cases}:
        cases = [case for case in flow_cases if (case["streaming"], case["finalize"]) == mode]
        requests = [request_of(case) for case in cases]
        short = request_of(cases[0])
        short.tokens = short.tokens[: len(short.tokens) // 2 + flow.config.pre_lookahead_len]
        requests.append(short)
        streaming, finalize = bool(mode[0]), bool(mode[1])
        batched = flow.inference(requests, streaming=streaming, finalize=finalize)
        for request, feat in zip(requests, batched, strict=True):
            (alone,) = flow.inference([request], streaming=streaming, finalize=finalize)
            torch.testing.assert_close(feat, alone, atol=BATCH_ATOL, rtol=0)


def test_streaming_mask_changes_the_result(flow: CausalMaskedDiffWithDiT, flow_cases: list[dict[str, Any]]) -> None:
    """Past one static chunk of frames, streaming attention differs from full attention (the test can tell)."""
    chunk = flow.config.estimator.static_chunk_size
    case = max(flow_cases, key=lambda c: c["mel_len1"] + c["mel_len2"])
    assert case["mel_len1"] + case["mel_len2"] > chunk, "the kit has no case longer than one attention chunk"
    finalize = bool(case["finalize"])
    (streamed,) = flow.inference([request_of(case)], streaming=True, finalize=finalize)
    (full,) = flow.inference([request_of(case)], streaming=False, finalize=finalize)
    assert not torch.allclose(streamed, full, atol=ATOL)


def test_no_mel_frames_is_a_clear_error(flow: CausalMaskedDiffWithDiT, flow_cases: list[dict[str, Any]]) -> None:
    request = request_of(flow_cases[0])
    request.tokens = request.tokens[: flow.config.pre_lookahead_len]
    with pytest.raises(InvalidInputError, match="look-ahead only"):
        flow.inference([request], finalize=False)


def test_config_rejects_the_v2_flow(kit: Path) -> None:
    spec = v3_yaml(kit)["flow"]
    spec.target = "cosyvoice.flow.flow.CausalMaskedDiffWithXvec"
    with pytest.raises(CheckpointError, match="CausalMaskedDiffWithDiT"):
        DiTFlowConfig.from_yaml(spec)
