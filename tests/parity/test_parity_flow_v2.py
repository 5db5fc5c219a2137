"""Numerical parity of what only the CosyVoice2 flow (`CausalMaskedDiffWithXvec`) has with the official one: its fixed
start noise and its checkpoint keys (what v1 and v2 share: test_parity_flow.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import CheckpointError
from engine.flow.causal import CausalFlowConfig, CausalMaskedDiffWithXvec
from engine.loading.checkpoint import load_strict, read_state_dict
from engine.loading.yaml_config import load_model_yaml
from tests.conftest import kit_group


@pytest.fixture(scope="module")
def flow_cases(v2_kit_cases: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return kit_group(v2_kit_cases, "flow")


def test_fixed_noise_matches(kit_flow_v2: CausalMaskedDiffWithXvec, flow_cases: list[dict[str, Any]]) -> None:
    for case in flow_cases:
        noise = case["noise"]
        assert torch.equal(kit_flow_v2.decoder.start_noise(noise.shape[-1]), noise), case["name"]


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
