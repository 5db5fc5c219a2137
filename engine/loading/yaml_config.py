"""Read the official HyperPyYAML model configs as plain data, without executing any tag.

HyperPyYAML tags become inert values:
- `!new:pkg.Class` (a mapping)  -> `ObjectSpec(target="pkg.Class", kwargs={...})`
- `!name:pkg.func` (a mapping)  -> `ObjectSpec(target="pkg.func", kwargs={...}, call=False)`
- `!apply:pkg.func [args]`      -> `None` (the seeding side effects are not ours to run)
- `!ref <key>` / `!ref <a> * <b>` -> the referenced value, or the arithmetic on referenced numbers
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.errors import CheckpointError


@dataclass
class ObjectSpec:
    """A `!new:` (call=True) or `!name:` (call=False) node: the class/function name and its arguments."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    call: bool = True

    def __getitem__(self, key: str) -> Any:
        return self.kwargs[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.kwargs.get(key, default)

    @property
    def class_name(self) -> str:
        return self.target.rsplit(".", 1)[-1]


def require(condition: bool, message: str) -> None:
    """CheckpointError(message) unless `condition`: a model config this implementation cannot reproduce."""
    if not condition:
        raise CheckpointError(message)


def expect_class(spec: object, expected: str, what: str) -> ObjectSpec:
    """`spec` as a `!new:` node of class `expected`; CheckpointError "unsupported <what> '<target>'; expected
    <expected>" for another class or a plain value."""
    found = spec.target if isinstance(spec, ObjectSpec) else type(spec).__name__
    require(
        isinstance(spec, ObjectSpec) and spec.class_name == expected,
        f"unsupported {what} {found!r}; expected {expected}",
    )
    return spec


@dataclass
class _Ref:
    expression: str


class _InertLoader(yaml.SafeLoader):
    """SafeLoader that turns HyperPyYAML tags into data."""


def _construct_tagged(kind: str):
    def construct(loader: _InertLoader, suffix: str, node: yaml.Node) -> Any:
        if kind == "apply":
            return None
        if isinstance(node, yaml.MappingNode):
            kwargs = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.ScalarNode) and loader.construct_scalar(node) in ("", None):
            kwargs = {}
        else:
            raise yaml.constructor.ConstructorError(
                None, None, f"!{kind}:{suffix} expects keyword arguments (a mapping)", node.start_mark
            )
        return ObjectSpec(target=suffix, kwargs=dict(kwargs), call=(kind == "new"))

    return construct


def _construct_ref(loader: _InertLoader, node: yaml.Node) -> _Ref:
    return _Ref(str(loader.construct_scalar(node)))


_InertLoader.add_multi_constructor("!new:", _construct_tagged("new"))
_InertLoader.add_multi_constructor("!name:", _construct_tagged("name"))
_InertLoader.add_multi_constructor("!apply:", _construct_tagged("apply"))
_InertLoader.add_constructor("!ref", _construct_ref)
# YAML 1.1 does not read "1e-06" as a float; HyperPyYAML (ruamel) does.
_InertLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

_REF_PATTERN = re.compile(r"<([^<>]+)>")
_ARITHMETIC = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}


def _evaluate_arithmetic(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _evaluate_arithmetic(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        return _ARITHMETIC[type(node.op)](_evaluate_arithmetic(node.left), _evaluate_arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate_arithmetic(node.operand)
    raise ValueError(f"unsupported expression element {ast.dump(node)}")


class _Resolver:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.resolving: set[str] = set()

    def lookup(self, key: str) -> Any:
        if key in self.resolving:
            raise ValueError(f"circular !ref to <{key}>")
        node: Any = self.root
        for part in key.split("."):
            if isinstance(node, ObjectSpec):
                node = node.kwargs
            if not isinstance(node, dict) or part not in node:
                raise ValueError(f"!ref <{key}> names no key")
            node = node[part]
        self.resolving.add(key)
        try:
            return self.resolve(node)
        finally:
            self.resolving.discard(key)

    def resolve(self, value: Any) -> Any:
        if isinstance(value, _Ref):
            whole = _REF_PATTERN.fullmatch(value.expression.strip())
            if whole:  # a plain reference keeps the referenced value's type (a list, a spec, ...)
                return self.lookup(whole.group(1))
            substituted = _REF_PATTERN.sub(lambda m: repr(self.lookup(m.group(1))), value.expression)
            return _evaluate_arithmetic(ast.parse(substituted, mode="eval"))
        if isinstance(value, ObjectSpec):
            value.kwargs = {k: self.resolve(v) for k, v in value.kwargs.items()}
            return value
        if isinstance(value, dict):
            for k in list(value):
                value[k] = self.resolve(value[k])
            return value
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        return value


def load_model_yaml(path: str | Path) -> dict[str, Any]:
    """Parse an official `cosyvoice.yaml` / `cosyvoice2.yaml` into plain data (see module docstring)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"cannot read model config {path}: {exc.strerror or exc}") from exc
    try:
        tree = yaml.load(text, Loader=_InertLoader)  # a SafeLoader subclass: no arbitrary objects
        if not isinstance(tree, dict):
            raise ValueError("the top level is not a mapping")
        return _Resolver(tree).resolve(tree)
    except (yaml.YAMLError, ValueError, SyntaxError) as exc:
        raise CheckpointError(f"malformed model config {path}: {exc}") from exc
