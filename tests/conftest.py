"""Shared fixtures: the conformance kits (overridable through COSYVOICE_CONFORMANCE_KIT) and their modules.

There is one kit per model family: `conformance_kit` (v1), `v2_kit`, `v3_kit`, and `each_kit` runs a test on
each of them. With COSYVOICE_CONFORMANCE_KIT set, that kit replaces the one of its own version and the tests of
the other versions skip. `kit_llm`, `kit_flow`, `kit_hift` (and the CosyVoice2 `kit_qwen2_llm`, `kit_flow_v2`,
`kit_hift_v2`) are built once per session through the loader (`engine.loading.loader.load_module`): a test that changes
a module (dtype, weights, attributes) must work on a `copy.deepcopy` of it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

from engine.families import families
from engine.flow.causal import CausalMaskedDiffWithXvec
from engine.flow.masked_diff import MaskedDiffWithXvec
from engine.llm.qwen2_lm import Qwen2LM
from engine.llm.transformer_lm import TransformerLM
from engine.loading.checkpoint import load_strict, read_state_dict
from engine.loading.loader import load_module
from engine.loading.yaml_config import load_model_yaml
from engine.vocoder.hift import HiFTGenerator

FIXTURES = Path(__file__).parent / "fixtures"
PARITY_TESTS = Path(__file__).parent / "parity"
DEFAULT_KITS = {1: FIXTURES / "cosyvoice1-tiny", 2: FIXTURES / "cosyvoice2-tiny", 3: FIXTURES / "cosyvoice3-tiny"}
KIT_YAMLS = {family.version: family.config_file for family in families()}  # the model yaml names the version
KIT_FIXTURES = {1: "conformance_kit", 2: "v2_kit", 3: "v3_kit"}
ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def kit_model_version(path: Path) -> int | None:
    """The CosyVoice version of the kit at `path`, from its model yaml's name; None unless exactly one is there."""
    found = [version for version, name in KIT_YAMLS.items() if (path / "model" / name).is_file()]
    return found[0] if len(found) == 1 else None


# how each version's meta `model_version` starts
KIT_MODEL_VERSIONS = {1: "CosyVoice v1", 2: "CosyVoice2", 3: "CosyVoice3"}


def _require_kit_layout(path: Path) -> int:
    """The kit's CosyVoice version; a kit without cases.pt and model/, or of no known version, fails the test
    (it must never pass with every test skipped)."""
    if not (path / "cases.pt").is_file() or not (path / "model").is_dir():
        pytest.fail(f"conformance kit {path} has no cases.pt or model/ directory")
    version = kit_model_version(path)
    if version is None:
        pytest.fail(
            f"conformance kit {path} is of unknown version: model/ must hold one of {sorted(KIT_YAMLS.values())}"
        )
    cases = torch.load(path / "cases.pt", weights_only=True)
    if not any(group != "meta" and cases[group] for group in cases):
        pytest.fail(f"conformance kit {path} has no cases")
    meta = cases.get("meta") or [{}]
    model_version = str(meta[0].get("model_version", ""))
    if not model_version.startswith(KIT_MODEL_VERSIONS[version]):
        pytest.fail(
            f"conformance kit {path}: model/{KIT_YAMLS[version]} says {KIT_MODEL_VERSIONS[version]}, but its meta "
            f"model_version is {model_version!r}"
        )
    return version


def version_kit(version: int) -> Path:
    """The kit of CosyVoice `version`: $COSYVOICE_CONFORMANCE_KIT when that is one, else the copy in tests/fixtures
    (unset, a default run checks every version); a kit of another version in the variable skips the caller."""
    path = Path(os.environ.get("COSYVOICE_CONFORMANCE_KIT", DEFAULT_KITS[version]))
    if _require_kit_layout(path) != version:
        pytest.skip(
            f"conformance kit {path} is not a {KIT_MODEL_VERSIONS[version]} kit (no model/{KIT_YAMLS[version]})"
        )
    return path


def kit_reference_sets(kit: Path, group: str) -> dict[str, list[dict[str, Any]]]:
    """The `group` cases of the kit's `cases.pt` and of each file in its `references/`: the same inputs with the
    official outputs recorded on another CPU kind (each case's `recorded_cpu` says which), by file name relative
    to the kit; a file without the group is left out."""
    sets = {}
    for path in [kit / "cases.pt", *sorted((kit / "references").glob("*.pt"))]:
        cases = torch.load(path, weights_only=True).get(group)
        if cases:
            sets[str(path.relative_to(kit))] = cases
    return sets


def kit_group(cases: dict[str, list[dict[str, Any]]], group: str) -> list[dict[str, Any]]:
    """The cases of one group; a kit without that group skips its tests (kits may cover different paths)."""
    if not cases.get(group):
        pytest.skip(f"this conformance kit has no {group!r} cases")
    return cases[group]


@pytest.fixture(scope="session")
def v2_kit() -> Path:
    """The CosyVoice2 kit (see `version_kit`)."""
    return version_kit(2)


@pytest.fixture(scope="session")
def v3_kit() -> Path:
    """The CosyVoice3 kit (see `version_kit`)."""
    return version_kit(3)


@pytest.fixture(scope="session")
def v2_kit_cases(v2_kit: Path) -> dict[str, list[dict[str, Any]]]:
    return torch.load(v2_kit / "cases.pt", weights_only=True)


@pytest.fixture(scope="session")
def kit_qwen2_llm(v2_kit: Path) -> Qwen2LM:
    """The v2 kit's LLM (its Qwen2 config from CosyVoice-BlankEN/config.json), strictly loaded from llm.pt."""
    return _kit_module(v2_kit, "llm", Qwen2LM)


@pytest.fixture(scope="session")
def kit_flow_v2(v2_kit: Path) -> CausalMaskedDiffWithXvec:
    """The v2 kit's causal flow, strictly loaded from flow.pt, in eval mode."""
    return _kit_module(v2_kit, "flow", CausalMaskedDiffWithXvec)


@pytest.fixture(scope="session")
def kit_hift_v2(v2_kit: Path) -> HiFTGenerator:
    """The v2 kit's vocoder (SineGen2 source), strictly loaded from hift.pt, in eval mode."""
    return _kit_module(v2_kit, "hift", HiFTGenerator)


@pytest.fixture(scope="module", params=list(KIT_FIXTURES.values()))
def each_kit(request: pytest.FixtureRequest) -> Path:
    """The v1 kit, then the v2 and v3 kits (a kit of another version in the variable skips the others)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module", params=[KIT_FIXTURES[1], KIT_FIXTURES[2]])
def v1_v2_kit(request: pytest.FixtureRequest) -> Path:
    """The v1 kit, then the v2 kit: for the checks v1 and CosyVoice2 share and CosyVoice3 does not (its modules
    differ: DiT flow, causal HiFT)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def each_kit_cases(each_kit: Path) -> dict[str, list[dict[str, Any]]]:
    return torch.load(each_kit / "cases.pt", weights_only=True)


@pytest.fixture(scope="module")
def each_kit_version(each_kit: Path) -> int:
    version = kit_model_version(each_kit)
    assert version is not None
    return version


@pytest.fixture(scope="session")
def conformance_kit() -> Path:
    """The CosyVoice v1 kit (see `version_kit`)."""
    return version_kit(1)


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/parity is a parity test."""
    for item in items:
        if PARITY_TESTS in item.path.parents:
            item.add_marker(pytest.mark.parity)


def _fail_if_ray_runs_unmarked(request: pytest.FixtureRequest) -> None:
    ray = sys.modules.get("ray")  # looked up, never imported here
    if ray is not None and ray.is_initialized() and request.node.get_closest_marker("serve") is None:
        pytest.fail(
            f"{request.node.nodeid} runs with Ray started but is not marked serve (pytestmark = pytest.mark.serve)"
        )


@pytest.fixture(autouse=True)
def _ray_only_in_serve_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that runs with Ray started in this process must be marked `serve`, so that `-m "not serve"` (the unit
    run) never starts Ray: checked before the test (Ray started by its fixtures) and after it (by its body)."""
    _fail_if_ray_runs_unmarked(request)
    yield
    _fail_if_ray_runs_unmarked(request)
