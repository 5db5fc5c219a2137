"""Shared fixtures: the conformance kit (overridable through COSYVOICE_CONFORMANCE_KIT)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"
DEFAULT_KIT = FIXTURES / "cosyvoice1-tiny"


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


@pytest.fixture(autouse=True)
def _single_thread_determinism() -> None:
    # The kits were recorded with one intra-op thread; the float32 tolerances assume it.
    torch.set_num_threads(1)
