"""Time-of-day windows with their own replica bounds, evaluated in an explicit time zone.

The controller's local zone is whatever the head node runs in, so every lookup converts the epoch
timestamp with the configured `zoneinfo` zone.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any
from zoneinfo import ZoneInfo


def _parse_clock(text: str) -> dt.time:
    if not isinstance(text, str):
        # YAML 1.1 (PyYAML, Serve's config loader) reads an unquoted 21:00 as the integer 1260.
        raise ValueError(f"time of day must be a quoted 'HH:MM' string, got {text!r}")
    try:
        hours, minutes = (int(part) for part in text.split(":"))
        return dt.time(0, 0) if (hours, minutes) == (24, 0) else dt.time(hours, minutes)
    except (ValueError, TypeError) as error:
        raise ValueError(f"time of day must be 'HH:MM', got {text!r}") from error


@dataclass(frozen=True)
class ScheduleWindow:
    """Replica bounds that hold between `start` and `end` ('HH:MM', end exclusive, may wrap midnight)."""

    name: str
    start: str
    end: str
    min_replicas: int | None = None
    max_replicas: int | None = None

    def __post_init__(self) -> None:
        if self._clocks[0] == self._clocks[1]:
            raise ValueError(f"window {self.name!r} is empty: start == end")
        for bound in (self.min_replicas, self.max_replicas):
            if bound is not None and bound < 0:
                raise ValueError(f"window {self.name!r}: replica bounds must be >= 0")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"window {self.name!r}: min_replicas > max_replicas")

    @cached_property
    def _clocks(self) -> tuple[dt.time, dt.time]:
        return _parse_clock(self.start), _parse_clock(self.end)

    def contains(self, clock: dt.time) -> bool:
        start, end = self._clocks
        if start < end:
            return start <= clock < end
        return clock >= start or clock < end  # wraps midnight

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> ScheduleWindow:
        return cls(**spec)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "start": self.start,
            "end": self.end,
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
        }


@dataclass(frozen=True)
class Schedule:
    """Ordered windows in one time zone; the first window containing the local time wins."""

    timezone: str = "UTC"
    windows: tuple[ScheduleWindow, ...] = ()

    def __post_init__(self) -> None:
        ZoneInfo(self.timezone)  # raises ZoneInfoNotFoundError on an unknown zone

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
        windows: Sequence[Mapping[str, Any]] = spec.get("windows", ())
        return cls(timezone=spec.get("timezone", "UTC"), windows=tuple(ScheduleWindow.from_dict(w) for w in windows))

    def to_dict(self) -> dict[str, Any]:
        return {"timezone": self.timezone, "windows": [window.to_dict() for window in self.windows]}
