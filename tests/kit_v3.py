"""The CosyVoice3 conformance kit under test and its modules, for the tests/test_parity_*_v3.py modules.

The kit is $COSYVOICE_CONFORMANCE_KIT when that holds a CosyVoice3 kit (model/cosyvoice3.yaml), else the copy in
tests/fixtures/cosyvoice3-tiny. Modules are built from the kit's yaml and loaded strictly from its checkpoints.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engine.checkpoint import load_strict, read_state_dict
from engine.yaml_config import load_model_yaml

DEFAULT_V3_KIT = Path(__file__).parent / "fixtures" / "cosyvoice3-tiny"
V3_YAML = "cosyvoice3.yaml"


def v3_kit_dir() -> Path:
    """The CosyVoice3 kit; skips the calling test when $COSYVOICE_CONFORMANCE_KIT names another version's kit."""
    path = Path(os.environ.get("COSYVOICE_CONFORMANCE_KIT", DEFAULT_V3_KIT))
    if not (path / "cases.pt").is_file() or not (path / "model").is_dir():
        pytest.fail(f"conformance kit {path} has no cases.pt or model/ directory")
    if not (path / "model" / V3_YAML).is_file():
        pytest.skip(f"conformance kit {path} is not a CosyVoice3 kit (no model/{V3_YAML})")
    return path


def v3_kit_cases(kit: Path) -> dict[str, list[dict[str, Any]]]:
    return torch.load(kit / "cases.pt", weights_only=True)


def v3_yaml(kit: Path) -> dict[str, Any]:
    return load_model_yaml(kit / "model" / V3_YAML)


def strictly_loaded(module: nn.Module, kit: Path, name: str) -> nn.Module:
    """`module` with `<kit>/model/<name>.pt` loaded strictly, in eval mode without gradients."""
    path = kit / "model" / f"{name}.pt"
    load_strict(module, read_state_dict(path), path)
    return module.eval().requires_grad_(False)
