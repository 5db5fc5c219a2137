"""Spell out a Serve config: add the `deployments:` blocks `serve build` would write for each app's `args`.

    python -m serve_app.full_config configs/gpu_cluster.yaml -o configs/serve_config.yaml

`serve build` imports an application object and cannot pass builder args; this builds each
`serve_app:build_app` application from its `args` and converts the deployments with Serve's own
`deployment_to_schema`, as `serve build` does. The `args` stay, so `serve deploy` of the output
builds the same app, and the blocks (equal to what the args build) show every option in force.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from ray.serve._private.build_app import build_app as build_deployments
from ray.serve.deployment import deployment_to_schema
from ray.serve.schema import ServeDeploySchema
from ray.serve.scripts import ServeDeploySchemaDumper

from serve_app.ingress import build_app

BUILDER = "serve_app:build_app"


def with_deployments(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with each builder application's `deployments` list as its `args` build them."""
    applications = []
    for application in config["applications"]:
        if application.get("import_path") == BUILDER:
            built = build_deployments(build_app(application.get("args") or {}), name=application["name"])
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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m serve_app.full_config", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="a Serve config whose apps use serve_app:build_app args")
    parser.add_argument("-o", "--output", type=Path, required=True)
    options = parser.parse_args(argv)
    text = render(yaml.safe_load(options.config.read_text()), options.config.as_posix())
    options.output.write_text(text)


if __name__ == "__main__":
    main()
