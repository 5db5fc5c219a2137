"""The base of every section of the app args (`serve_app.args`): strict, frozen, removed fields refused with
what replaced them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


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
