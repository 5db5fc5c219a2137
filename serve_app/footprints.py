"""The memory of a decoder replica on a GPU, estimated (`DecoderMemory`) or measured on a card
(`MeasuredFootprint`), and the error a plan stops on (`PlanError`).

A footprint measured on a card replaces that estimate: `benchmarks/gpu_check.sh`'s plan_check part writes each
replica's peak memory (nvidia-smi's figure per process, CUDA context included) beside the plan it ran; its
`plan_check.json`, kept in RECORDED_DIR (docs/gpu_check/), is read by `recorded_footprints`, and `plan_for`
(`serve_app.plan`) uses the largest peak recorded for the same card name, dtypes, batch size, weights and loop budget
in place of the estimated total when it counts the replicas a card holds (each replica's fraction still holds its
allocator share). The plan says which it used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from serve_app.inventory import GIB

# The GPU check's plan_check reports kept for the plan (the module docstring); absent outside a checkout of the repo
RECORDED_DIR = Path(__file__).resolve().parents[1] / "docs" / "gpu_check"


class PlanError(ValueError):
    """The machine cannot run the app as asked (a card too small for one decoder replica, cuda without a GPU), or a
    recorded footprint cannot be read. Here, below `serve_app.plan`, since `recorded_footprints` raises it too."""


@dataclass(frozen=True)
class MeasuredFootprint:
    """A decoder replica's peak memory on a card, as a plan_check report recorded it, and what it was measured for."""

    gpu_name: str
    dtypes: dict[str, str]
    max_batch_size: int
    weights_bytes: int
    budget_bytes: int
    peak_bytes: int
    source: str  # the report's path


@dataclass(frozen=True)
class DecoderMemory:
    """One GPU decoder replica's memory: its allocator's share holds the weights, the loop's budget and the reserve
    beside them (`engine.runtime.memory.memory_budget_for`); the CUDA context lies outside the share. A recorded
    peak per replica, where there is one, stands for the whole in place of that estimate."""

    weights_bytes: int
    budget_bytes: int
    share_bytes: int
    context_bytes: int
    measured_bytes: int | None = None
    measured_in: str | None = None

    @property
    def reserve_bytes(self) -> int:
        return self.share_bytes - self.weights_bytes - self.budget_bytes

    @property
    def estimated_bytes(self) -> int:
        return self.share_bytes + self.context_bytes

    @property
    def total_bytes(self) -> int:
        return self.estimated_bytes if self.measured_bytes is None else self.measured_bytes

    def describe(self) -> str:
        estimate = (
            f"weights {self.weights_bytes / GIB:.2f} GiB + loop budget {self.budget_bytes / GIB:.2f} GiB + reserve "
            f"{self.reserve_bytes / GIB:.2f} GiB (the allocator's share, {self.share_bytes / GIB:.2f} GiB) + CUDA "
            f"context ~{self.context_bytes / GIB:.2f} GiB (an estimate) = {self.estimated_bytes / GIB:.2f} GiB"
        )
        if self.measured_bytes is None:
            return estimate
        measured = f"{self.measured_bytes / GIB:.2f} GiB measured at its peak ({self.measured_in})"
        return f"{measured}, in place of the estimate: {estimate}"


def recorded_footprints(directory: Path | None = None) -> tuple[MeasuredFootprint, ...]:
    """The footprints of the plan_check reports (`benchmarks/plan_check.py`'s JSON) in `directory` (default
    RECORDED_DIR; none where it does not exist). PlanError, naming the file, for one that is not a complete report of
    a run on a GPU."""
    directory = RECORDED_DIR if directory is None else directory
    footprints = []
    for path in sorted(directory.glob("*.json")):
        try:
            report = json.loads(path.read_text())
            plan, peaks = report["plan"], report["per_replica_peak_bytes"]
            if not (report["complete"] and plan["device"] == "cuda" and peaks):
                raise ValueError("it did not run to its end on a GPU with nvidia-smi's readings")
            planned_card = min(plan["inventory"]["gpus"], key=lambda gpu: gpu["memory_bytes"])
            footprints.append(
                MeasuredFootprint(
                    gpu_name=planned_card["name"],
                    dtypes=plan["dtypes"],
                    max_batch_size=plan["max_batch_size"],
                    weights_bytes=plan["memory"]["weights_bytes"],
                    budget_bytes=plan["memory"]["budget_bytes"],
                    peak_bytes=max(peaks),
                    source=str(path),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:  # json's JSONDecodeError is a ValueError
            raise PlanError(
                f"{path} is not a complete plan_check report of a GPU run ({type(exc).__name__}: {exc}); "
                f"{directory} holds only those (benchmarks/plan_check.py)"
            ) from None
    return tuple(footprints)
