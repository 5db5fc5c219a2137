"""The import layering of the project's packages, read from the source with `ast` (nothing is imported).

Every import counts, whether at module level, inside a function or under `TYPE_CHECKING`. The test fails on an
import cycle between modules and on an import from a lower layer to a higher one; docs/architecture.md draws the
same layers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "observability", "deployments", "autoscaling", "serve_app", "benchmarks")

# The layer of each module, by its longest listed prefix: a module may import only modules of its own layer or a
# lower one. Inside the engine: what everything reads (errors, the yaml and checkpoint formats) < shared layers <
# the stages < the families, which name the stage classes of each version < what asks the families (the loader,
# voice cloning) < the runtime that serves requests < the `python -m engine` command. Then the deployments and the
# autoscaler on top of the engine, the ingress and the CLI on top of them, and the benchmark scripts over everything.
LAYERS: dict[str, int] = {
    "engine.errors": 0,
    "engine.loading.yaml_config": 0,
    "engine.loading.checkpoint": 0,
    "engine.nn": 1,
    "engine.text": 2,
    "engine.llm": 2,
    "engine.flow": 2,
    "engine.vocoder": 2,
    "engine.voices.spec": 2,
    "engine.voices.speaker_bank": 2,
    "engine.families": 3,
    "engine.loading": 4,
    "engine.voices": 4,
    "engine.runtime": 5,
    "engine.__main__": 6,
    "engine": 6,  # the package's own __init__ (a docstring)
    "observability": 6,
    "deployments": 7,
    "autoscaling": 7,
    "serve_app": 8,
    "benchmarks": 9,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imported_modules(path: Path, name: str, modules: set[str]) -> set[str]:
    """The project modules `path` (module `name`) imports: `from a.b import c` is a.b.c when that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a non-module attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(path, name, set(modules)) for name, path in modules.items()}


def layer_of(module: str) -> int:
    prefixes = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    if not prefixes:
        raise AssertionError(f"{module} has no layer: add its package to LAYERS")
    return LAYERS[max(prefixes, key=len)]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    )


def test_the_graph_sees_the_imports_that_matter() -> None:
    graph = import_graph()
    assert "engine.families" in graph["engine.voices.cloning"]  # `from engine.families import families`
    assert "engine.nn.layers" in graph["engine.nn.precision"]  # `from engine.nn import layers`
    assert "engine.runtime.segment" in graph["engine.runtime.streaming"]
    assert "engine.runtime.encoder_stage" in graph["deployments.encoder"]


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    assert upward_imports(import_graph()) == []


def installed_packages() -> set[str]:
    """The packages `pip install` puts in place (pyproject.toml's `packages.find` include)."""
    [include] = re.findall(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    return set(re.findall(r'"(\w+)\*"', include))


def test_installed_packages_import_only_installed_packages() -> None:
    # `cosyvoice-serve` runs from an installed copy, where the benchmark scripts (run from a checkout) are missing
    installed = installed_packages()
    assert "serve_app" in installed and "benchmarks" not in installed
    outside = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.partition(".")[0] in installed
        for target in targets
        if target.partition(".")[0] not in installed
    )
    assert outside == []


@pytest.mark.parametrize(
    ("graph", "cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": set(), "c": {"a", "b"}}, None),
    ],
)
def test_find_cycle_finds_a_loop_and_only_a_loop(graph: dict[str, set[str]], cycle: list[str] | None) -> None:
    assert find_cycle(graph) == cycle


def test_an_upward_import_is_reported() -> None:
    # a type-only import of the runtime from the registry was the loop this layering removed
    graph = {"engine.families.base": {"engine.runtime.streaming"}, "engine.runtime.streaming": set()}
    assert upward_imports(graph) == [
        "engine.families.base (layer 3) imports engine.runtime.streaming (layer 5)",
    ]
