"""Spell out a Serve config: add the `deployments:` blocks `serve build` would write for each app's `args`.

    python -m serve_app.full_config configs/gpu_cluster.yaml -o configs/serve_config.yaml
    python -m serve_app.full_config --knobs          # every app arg: its default and what it does, as a table

`serve build` imports an application object and cannot pass builder args; this builds each
`serve_app:build_app` application from its `args` with its `deployments:` overrides and converts the
deployments with Serve's own `deployment_to_schema`, as `serve build` does. The `args` stay, so
`serve deploy` of the output builds the same app, and the blocks (what the args build with the
overrides) show every option in force.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from ray.serve._private.build_app import build_app as build_deployments
from ray.serve.deployment import deployment_to_schema
from ray.serve.schema import ServeDeploySchema
from ray.serve.scripts import ServeDeploySchemaDumper

from serve_app.args import AppArgs
from serve_app.ingress import build_app_with_overrides

BUILDER = "serve_app:build_app"


def with_deployments(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with each builder application's `deployments` list as its `args` build them with its own
    `deployments` overrides."""
    applications = []
    for application in config["applications"]:
        if application.get("import_path") == BUILDER:
            app = build_app_with_overrides(application.get("args") or {}, application.get("deployments"))
            built = build_deployments(app, name=application["name"])
            schemas = [deployment_to_schema(d).model_dump(exclude_unset=True) for d in built.deployments]
            application = {**application, "deployments": schemas}
        applications.append(application)
    full = {**config, "applications": applications}
    ServeDeploySchema.model_validate(full)
    return full


def render(config: dict[str, Any], source: str) -> str:
    header = f"# Generated from {source} by `python -m serve_app.full_config`: do not edit; a test regenerates it.\n\n"
    body = yaml.dump(
        with_deployments(config), Dumper=ServeDeploySchemaDumper, default_flow_style=False, sort_keys=False, width=80
    )
    return header + body.rstrip("\n") + "\n"


def sections_in(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models a field's type holds: the type itself, or inside Optional, unions, Annotated, tuples."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for argument in typing.get_args(annotation) for model in sections_in(argument)]


def leaf_knobs(model: type[BaseModel] = AppArgs, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every leaf knob of the app args by its dotted path: a field whose type holds a model (itself, optional, or a
    tuple of them, such as `voices` and a schedule's `windows`) is a section, walked into; every other field is a
    leaf, once per place a config can set it (`decoder.autoscaling.rules.max_replicas` and
    `decoder_cpu.max_replicas` are two)."""
    for name, info in model.model_fields.items():
        sections = sections_in(info.annotation)
        if not sections:
            yield prefix + name, info
        for section in sections:
            yield from leaf_knobs(section, f"{prefix}{name}.")


def _default_of(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    default = info.get_default(call_default_factory=True)
    return f"`{default.model_dump(mode='json') if isinstance(default, BaseModel) else default!r}`"


def knob_table() -> str:
    """A Markdown table of every leaf knob: its path, default and description (args.py's, the one place each is
    documented)."""
    rows = ["| knob | default | what it does |", "|---|---|---|"]
    for path, info in leaf_knobs():
        description = (info.description or "").replace("|", "\\|")
        rows.append(f"| `{path}` | {_default_of(info)} | {description} |")
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m serve_app.full_config", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, nargs="?", help="a Serve config whose apps use serve_app:build_app args")
    parser.add_argument("-o", "--output", type=Path, help="where to write it (default: standard output)")
    parser.add_argument("--knobs", action="store_true", help="print every app arg's default and description instead")
    options = parser.parse_args(argv)
    if options.knobs == (options.config is not None):
        parser.error("give either a config or --knobs")
    if options.knobs:
        text = knob_table()
    else:
        text = render(yaml.safe_load(options.config.read_text()), options.config.as_posix())
    if options.output is None:
        sys.stdout.write(text)
    else:
        options.output.write_text(text)


if __name__ == "__main__":
    main()
