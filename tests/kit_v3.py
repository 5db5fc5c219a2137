"""The CosyVoice3 conformance kit under test and its modules, for the tests/test_parity_*_v3.py modules.

The kit is $COSYVOICE_CONFORMANCE_KIT when that holds a CosyVoice3 kit (model/cosyvoice3.yaml), else the copy in
tests/fixtures/cosyvoice3-tiny (conftest's `version_kit`, as for the other versions). Modules are built from the
kit's yaml and loaded strictly from its checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from conftest import version_kit
from torch import nn

from engine.loading.checkpoint import load_strict, read_state_dict
from engine.loading.yaml_config import load_model_yaml

V3_YAML = "cosyvoice3.yaml"


def v3_kit_dir() -> Path:
    """The CosyVoice3 kit (conftest's `version_kit`); skips the caller when $COSYVOICE_CONFORMANCE_KIT names
    another version's kit."""
    return version_kit(3)


def v3_kit_cases(kit: Path) -> dict[str, list[dict[str, Any]]]:
    return torch.load(kit / "cases.pt", weights_only=True)


def v3_yaml(kit: Path) -> dict[str, Any]:
    return load_model_yaml(kit / "model" / V3_YAML)


def strictly_loaded(module: nn.Module, kit: Path, name: str) -> nn.Module:
    """`module` with `<kit>/model/<name>.pt` loaded strictly, in eval mode without gradients."""
    path = kit / "model" / f"{name}.pt"
    load_strict(module, read_state_dict(path), path)
    return module.eval().requires_grad_(False)
