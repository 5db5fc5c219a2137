"""Serve's own options of the app's deployments: the code's defaults, and the overrides of a Serve config's
`deployments:` section over them, with Serve's semantics.

Replica counts, CPUs, request bounds and custom resources of the ingress, the encoders, the CPU fallback decoder and
the Wyoming listener are not app args: a Serve config sets them per deployment (`serve run`, `serve deploy` and
`serve build` apply that section themselves; `cosyvoice-serve run` passes it to `build_app_with_overrides`). The GPU
Decoder's `ray_actor_options` are built from `decoder.num_cpus` / `decoder.num_gpus`, which the plan and the memory
budget read: an override of them is refused.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from copy import deepcopy
from typing import Any

from pydantic import ValidationError
from ray.serve.schema import DeploymentSchema

from serve_app.routing import CPU_DECODER, GPU_DECODER

INGRESS = "TTSIngress"
ENCODER = "Encoder"
WYOMING = "WyomingServer"
DEPLOYMENT_NAMES = (INGRESS, ENCODER, GPU_DECODER, CPU_DECODER, WYOMING)

DOCS = "docs/deploy.md, Deployment options"
# Serve's own default when ray_actor_options name no CPUs (an override replaces the code's options whole):
# ray.serve._private.config.ReplicaConfig.
SERVE_DEFAULT_NUM_CPUS = 1.0


def cpu_actor_options(num_cpus: float) -> dict[str, Any]:
    """A CPU-only replica."""
    return {"num_cpus": num_cpus, "num_gpus": 0}


# The code's options of each deployment, before a Serve config's overrides. The GPU Decoder's bounds and actor options
# follow the decoder args (`build_app_with_overrides`); the CPU fallback's replica count is its policy's.
DEFAULT_OPTIONS: Mapping[str, Mapping[str, Any]] = {
    INGRESS: {
        "num_replicas": 1,
        "max_ongoing_requests": 64,
        "max_queued_requests": 256,
        "ray_actor_options": cpu_actor_options(0.25),
    },
    ENCODER: {
        "num_replicas": 1,
        "max_ongoing_requests": 8,
        "max_queued_requests": 64,
        "ray_actor_options": cpu_actor_options(0.5),
    },
    GPU_DECODER: {"num_replicas": 1, "max_queued_requests": 64},
    CPU_DECODER: {"max_ongoing_requests": 8, "max_queued_requests": 32, "ray_actor_options": cpu_actor_options(1.0)},
    WYOMING: {"ray_actor_options": cpu_actor_options(0.1)},  # it only relays text and audio
}


def moved_to_deployment(option: str, deployment: str) -> str:
    """The message of a removed app arg that a Serve config now sets as `option` of `deployment`."""
    return f"set `{option}` of deployment `{deployment}` in the Serve config's `deployments:` ({DOCS})"


def parse_overrides(
    deployments: Sequence[Mapping[str, Any]] | None, deployed: Collection[str]
) -> dict[str, dict[str, Any]]:
    """A Serve config's `deployments:` entries as {deployment name: the options it sets}, each checked against
    Serve's `DeploymentSchema` and the names `deployed` (ValueError naming what is allowed)."""
    allowed_options = sorted(set(DeploymentSchema.model_fields) - {"name"})
    overrides: dict[str, dict[str, Any]] = {}
    for entry in deployments or ():
        name = entry.get("name")
        if name not in deployed:
            raise ValueError(f"deployments: no deployment {name!r} in this app; its deployments: {sorted(deployed)}")
        if name in overrides:
            raise ValueError(f"deployments: {name} is listed twice")
        unknown = sorted(set(entry) - set(DeploymentSchema.model_fields))
        if unknown:
            raise ValueError(
                f"deployments: {name} has no option {', '.join(unknown)}; Serve's options: {allowed_options}"
            )
        try:
            schema = DeploymentSchema.model_validate(entry)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, error['loc']))}: {error['msg']}" if error["loc"] else error["msg"]
                for error in exc.errors()
            )
            raise ValueError(f"deployments: {name}: {problems}") from None
        overrides[name] = schema.model_dump(exclude_unset=True, exclude={"name"})
    return overrides


def effective_options(code: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """The options a deployment runs with, as Serve applies a config's override to the code's: each option given
    replaces the code's whole (`ray_actor_options` too); where an autoscaling_config ends up set, a fixed replica count
    beside it is not in force (Serve keeps the autoscaling), so it is left out."""
    options = deepcopy({**code, **override})  # Ray may fill in the dicts it is given: never the shared defaults
    if options.get("autoscaling_config") is not None and isinstance(options.get("num_replicas"), int):
        del options["num_replicas"]
    return options


def replica_floor(options: Mapping[str, Any]) -> int:
    """The fewest replicas a deployment with `options` runs: its autoscaling floor, else its fixed count."""
    scaling = options.get("autoscaling_config")
    if scaling is not None:
        return int(scaling.get("min_replicas", 1))
    count = options.get("num_replicas", 1)
    return count if isinstance(count, int) else 1  # "auto": Serve's autoscaling floor, 1


def replica_num_cpus(options: Mapping[str, Any]) -> float:
    """The CPUs Ray reserves for each replica of a deployment with `options`."""
    return float((options.get("ray_actor_options") or {}).get("num_cpus", SERVE_DEFAULT_NUM_CPUS))


def with_options(
    deployments: Sequence[Mapping[str, Any]], name: str, options: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """`deployments` (a Serve config's section) with `options` set in `name`'s entry (added where it has none)."""
    entries = [dict(entry) for entry in deployments]
    for entry in entries:
        if entry.get("name") == name:
            entry.update(options)
            return entries
    return [*entries, {"name": name, **options}]
