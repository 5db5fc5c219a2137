"""The base of every section of the app args (`serve_app.args`): strict, frozen, removed fields refused with
what replaced them; the Serve options every request-serving replica kind has."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo


class StrictArgs(BaseModel):
    # Inputs stay out of error messages: they may hold API keys.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    # Fields this section had and no longer has: name -> what replaced it, or why it went. A config that still sets
    # one is refused with that message rather than pydantic's bare "extra inputs are not permitted".
    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            removed = [f"{name} was removed: {cls.REMOVED_FIELDS[name]}" for name in cls.REMOVED_FIELDS if name in data]
            if removed:
                raise ValueError("; ".join(removed))
        return data


QUEUE_DESCRIPTION = "requests waiting for a replica beyond this are answered 503 + Retry-After; None: unbounded"

CPU_RESOURCES_MOVED = "cpu_resources (a top-level field) places every CPU replica: ingress, encoders, CPU fallback"

CPU_REPLICA_SECTIONS = ("ingress", "encoder", "decoder_cpu")


class ReplicaArgs(StrictArgs):
    """The Serve options every request-serving deployment has (where a replica may run: `AppArgs.cpu_resources`)."""

    REMOVED_FIELDS = {"resources": CPU_RESOURCES_MOVED}

    num_cpus: float = Field(0.5, gt=0, description="CPUs Ray reserves for each replica")
    max_ongoing_requests: int = Field(8, ge=1, description="requests one replica takes at once (Serve's)")
    max_queued_requests: int | None = Field(64, ge=1, description=QUEUE_DESCRIPTION)


def inherited(base: type[BaseModel], name: str, default: Any) -> Any:
    """`base`'s field `name` with another default: its constraints and description stay the base's (one
    documentation for every replica kind)."""
    return FieldInfo.merge_field_infos(base.model_fields[name], default=default)
