"""Helpers for tests of the decoder loop (engine.runtime.scheduler): a sink that keeps what a request handed on, and
stepping the loop until a condition holds."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.runtime.scheduler import Output, Scheduler


class Collected:
    """A sink that keeps what a request handed on: audio arrays, then an error if one ended it, then None."""

    def __init__(self) -> None:
        self.outputs: list[Output] = []

    def __call__(self, item: Output) -> None:
        self.outputs.append(item)

    @property
    def ended(self) -> bool:
        return bool(self.outputs) and self.outputs[-1] is None

    @property
    def chunks(self) -> list[np.ndarray]:
        """The audio handed on, as it came, of a request that ended without an error."""
        assert self.ended and all(isinstance(o, np.ndarray) for o in self.outputs[:-1]), self.outputs
        return self.outputs[:-1]

    @property
    def audio(self) -> np.ndarray:
        """All its audio in one array."""
        return np.concatenate([chunk for chunk in self.chunks if chunk.size])

    @property
    def error(self) -> Exception | None:
        """The error that ended the request, if one did."""
        return self.outputs[-2] if len(self.outputs) >= 2 and isinstance(self.outputs[-2], Exception) else None


def step_until(scheduler: Scheduler, condition: Callable[[], bool], limit: int = 2000) -> None:
    """Step the loop until `condition()` holds; fail (never hang) after `limit` steps."""
    for _ in range(limit):
        if condition():
            return
        scheduler.step()
    raise AssertionError(f"not reached in {limit} steps")
