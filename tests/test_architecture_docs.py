"""docs/architecture.md's request-path table against the code: every hop names a file that exists and classes,
methods and functions defined in it (read with `ast`), and the route groups send `/v1/audio/speech` to the method the
table names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## The path of one request"
CODE = re.compile(r"`([^`]+)`")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def request_path_rows() -> list[tuple[str, str]]:
    """(hop, where) of each row of the request-path table."""
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]  # the header row aside
    return [(hop, where) for hop, where in cells]


def references(where: str) -> list[tuple[str, str]]:
    """(file, name) of a `where` cell: each `path.py` then the names defined in it, until the next path."""
    found, path = [], None
    for code in CODE.findall(where):
        if code.endswith(".py"):
            path = code
        else:
            assert path is not None and NAME.fullmatch(code), f"{code!r} in {where!r}: not a name after a file"
            found.append((path, code))
    return found


def defined_names(path: Path) -> set[str]:
    """The module-level classes, functions and assignments of `path`, and each class's methods as Class.method."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            methods = (item for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef))
            names.update(f"{node.name}.{method.name}" for method in methods)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


def test_every_hop_names_code_that_exists() -> None:
    rows = request_path_rows()
    assert len(rows) >= 10, rows
    missing = []
    for hop, where in rows:
        refs = references(where)
        assert refs, f"the hop {hop!r} names no code"
        for path, name in refs:
            file = ROOT / path
            if not file.is_file() or name not in defined_names(file):
                missing.append(f"{path} {name} ({hop})")
    assert not missing, "docs/architecture.md's request path names code that is not there:\n" + "\n".join(missing)


def test_the_speech_route_is_the_method_the_table_names() -> None:
    from types import SimpleNamespace

    from fastapi.routing import APIRoute

    from serve_app.openai_routes import OpenAIRoutes

    named = {name for _, where in request_path_rows() for _, name in references(where)}
    routes = OpenAIRoutes(SimpleNamespace()).router().routes
    [speech] = [route for route in routes if isinstance(route, APIRoute) and route.path == "/v1/audio/speech"]
    assert speech.methods == {"POST"}
    assert f"{OpenAIRoutes.__name__}.{speech.endpoint.__name__}" in named


def test_a_name_that_is_not_defined_is_found_missing(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text("class Route:\n    async def speech(self): ...\n\n\ndef helper(): ...\n\nLIMIT = 1\n")
    assert defined_names(module) == {"Route", "Route.speech", "helper", "LIMIT"}
    assert references("`a.py` `Route.speech`, `helper`; `b.py` `LIMIT`") == [
        ("a.py", "Route.speech"),
        ("a.py", "helper"),
        ("b.py", "LIMIT"),
    ]
