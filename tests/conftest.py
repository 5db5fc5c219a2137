"""Shared fixtures: the conformance kit (overridable through COSYVOICE_CONFORMANCE_KIT) and its modules.

`kit_llm`, `kit_flow` and `kit_hift` are built once per session: a test that changes a module (dtype, weights,
attributes) must work on a `copy.deepcopy` of it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from engine.flow import MaskedDiffWithXvec
from engine.hift import HiFTGenerator
from engine.llm import TransformerLM
from engine.loader import load_module

FIXTURES = Path(__file__).parent / "fixtures"
DEFAULT_KIT = FIXTURES / "cosyvoice1-tiny"
ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def kit_dir() -> Path:
    """The kit under test: $COSYVOICE_CONFORMANCE_KIT, else the copy in tests/fixtures."""
    return Path(os.environ.get("COSYVOICE_CONFORMANCE_KIT", DEFAULT_KIT))


@pytest.fixture(scope="session")
def conformance_kit() -> Path:
    path = kit_dir()
    if not (path / "cases.pt").is_file() or not (path / "model").is_dir():
        pytest.fail(f"conformance kit {path} has no cases.pt or model/ directory")
    return path


@pytest.fixture(scope="session")
def kit_cases(conformance_kit: Path) -> dict[str, list[dict[str, Any]]]:
    return torch.load(conformance_kit / "cases.pt", weights_only=True)


def _kit_module(kit: Path, name: str, kind: type[ModuleT]) -> ModuleT:
    module = load_module(kit / "model", name)
    assert isinstance(module, kind)
    return module


@pytest.fixture(scope="session")
def kit_llm(conformance_kit: Path) -> TransformerLM:
    """The kit's LLM, strictly loaded from llm.pt, in eval mode."""
    return _kit_module(conformance_kit, "llm", TransformerLM)


@pytest.fixture(scope="session")
def kit_flow(conformance_kit: Path) -> MaskedDiffWithXvec:
    """The kit's flow, strictly loaded from flow.pt, in eval mode."""
    return _kit_module(conformance_kit, "flow", MaskedDiffWithXvec)


@pytest.fixture(scope="session")
def kit_hift(conformance_kit: Path) -> HiFTGenerator:
    """The kit's vocoder, strictly loaded from hift.pt (legacy weight-norm keys accepted), in eval mode."""
    return _kit_module(conformance_kit, "hift", HiFTGenerator)


@pytest.fixture(autouse=True)
def _single_thread_determinism() -> None:
    # The kits were recorded with one intra-op thread; the float32 tolerances assume it.
    torch.set_num_threads(1)
