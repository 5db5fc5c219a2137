"""Time-of-day windows with their own replica bounds, evaluated in an explicit time zone.

The controller's local zone is whatever the head node runs in, so every lookup converts the epoch
timestamp with the configured `zoneinfo` zone.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from functools import cached_property
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def _parse_clock(text: str) -> dt.time:
    if not isinstance(text, str):
        # YAML 1.1 (PyYAML, Serve's config loader) reads an unquoted 21:00 as the integer 1260.
        raise ValueError(f"time of day must be a quoted 'HH:MM' string, got {text!r}")
    try:
        hours, minutes = (int(part) for part in text.split(":"))
        return dt.time(0, 0) if (hours, minutes) == (24, 0) else dt.time(hours, minutes)
    except (ValueError, TypeError) as error:
        raise ValueError(f"time of day must be 'HH:MM', got {text!r}") from error


class _Rules(BaseModel):
    """A frozen part of the policy's rules: validated once (from the app args or Serve's `policy_kwargs`), unknown
    keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ScheduleWindow(_Rules):
    """Replica bounds that hold between `start` and `end` ('HH:MM', end exclusive, may wrap midnight)."""

    name: str = Field(description="the window's name, in the logs and the plan")
    start: str = Field(description="'HH:MM' (quoted in YAML: an unquoted 21:00 reads as a number)")
    end: str = Field(description="'HH:MM', exclusive; before `start`: the window wraps midnight")
    min_replicas: int | None = Field(None, ge=0, description="the floor inside the window; None: the rules' own")
    max_replicas: int | None = Field(None, ge=0, description="the ceiling inside the window; None: the rules' own")

    @field_validator("start", "end", mode="before")
    @classmethod
    def _clock_text(cls, text: Any) -> str:
        _parse_clock(text)
        return text

    @model_validator(mode="after")
    def _not_empty_nor_inverted(self) -> ScheduleWindow:
        if self.clocks[0] == self.clocks[1]:
            raise ValueError(f"window {self.name!r} is empty: start == end")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"window {self.name!r}: min_replicas > max_replicas")
        return self

    @cached_property
    def clocks(self) -> tuple[dt.time, dt.time]:
        return _parse_clock(self.start), _parse_clock(self.end)

    def contains(self, clock: dt.time) -> bool:
        start, end = self.clocks
        if start < end:
            return start <= clock < end
        return clock >= start or clock < end  # wraps midnight

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> ScheduleWindow:
        return cls.model_validate(spec)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class Schedule(_Rules):
    """Ordered windows in one time zone; the first window containing the local time wins."""

    timezone: str = Field("UTC", description="the zoneinfo zone the windows' clocks are read in, e.g. Asia/Shanghai")
    windows: tuple[ScheduleWindow, ...] = Field((), description="each with its own replica bounds; the first wins")

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, timezone: str) -> str:
        try:
            ZoneInfo(timezone)
        except (ZoneInfoNotFoundError, ValueError):  # ValueError: a malformed key such as a path
            raise ValueError(f"unknown time zone {timezone!r}") from None
        return timezone

    def active_window(self, timestamp: float) -> ScheduleWindow | None:
        clock = dt.datetime.fromtimestamp(timestamp, tz=ZoneInfo(self.timezone)).time()
        return next((window for window in self.windows if window.contains(clock)), None)

    def bounds_at(self, timestamp: float, default_min: int, default_max: int) -> tuple[int, int]:
        """(min, max) replicas at an epoch timestamp; a window overrides only the bounds it sets."""
        window = self.active_window(timestamp)
        low = default_min if window is None or window.min_replicas is None else window.min_replicas
        high = default_max if window is None or window.max_replicas is None else window.max_replicas
        return low, max(low, high)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> Schedule:
        return cls.model_validate(spec)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
