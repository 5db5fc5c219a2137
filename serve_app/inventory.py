"""What this machine offers the app: the GPUs nvidia-smi lists (those CUDA_VISIBLE_DEVICES names), their memory and
whether they compute bfloat16 natively, the CPUs this process may run on and the CPU's units. The plan for the
machine (`serve_app.plan`) is made for such an inventory.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from engine.nn.precision import CpuCapabilities, cpu_capabilities

GIB = 2**30
# Native bfloat16 from Ampere (compute capability 8.0) on.
BFLOAT16_CAPABILITY = 8.0


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    native_bfloat16: bool


@dataclass(frozen=True)
class Inventory:
    """What the app can use: the GPUs and CPUs Ray sees, and the CPU's units (the CPU decoders' `auto` dtypes)."""

    gpus: tuple[Gpu, ...]
    cpus: float
    cpu: CpuCapabilities

    def describe(self) -> str:
        if not self.gpus:
            return f"no GPU, {self.cpus:g} CPUs"
        cards = ", ".join(
            f"{gpu.name} {gpu.memory_bytes / GIB:.1f} GiB{'' if gpu.native_bfloat16 else ' (no native bfloat16)'}"
            for gpu in self.gpus
        )
        return f"{len(self.gpus)} GPU(s): {cards}; {self.cpus:g} CPUs"


def gpus_from_nvidia_smi(
    environ: Mapping[str, str] = os.environ, command: str = "nvidia-smi", timeout_s: float = 10.0
) -> tuple[Gpu, ...]:
    """The GPUs `nvidia-smi` lists (none where it is missing or fails), those CUDA_VISIBLE_DEVICES names (by index or
    UUID) where it is set: what a CUDA process here, and Ray, sees. nvidia-smi, not CUDA: this process must not hold a
    CUDA context on the card it is planning for."""
    if shutil.which(command, path=environ.get("PATH")) is None:
        return ()
    query = "--query-gpu=index,uuid,name,memory.total,compute_cap"
    try:
        result = subprocess.run(
            [command, query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=dict(environ),
        )
    except (OSError, subprocess.TimeoutExpired):
        return ()
    if result.returncode != 0:
        return ()
    rows = [[field.strip() for field in row] for row in csv.reader(result.stdout.splitlines()) if len(row) == 5]
    cards = {
        (index, uuid): Gpu(name, int(float(mib)) * 2**20, float(capability) >= BFLOAT16_CAPABILITY)
        for index, uuid, name, mib, capability in rows
    }
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return tuple(cards.values())
    chosen = []
    for wanted in (item.strip() for item in visible.split(",") if item.strip()):
        match = [gpu for (index, uuid), gpu in cards.items() if wanted == index or uuid.startswith(wanted)]
        if not match:  # CUDA stops at the first device it cannot find
            break
        chosen.append(match[0])
    return tuple(chosen)


def inventory_here(gpus_seen: int | None = None, cpus: float | None = None) -> Inventory:
    """This machine's inventory: the GPUs nvidia-smi lists (the first `gpus_seen`: those Ray sees, in `run`) and
    `cpus` (default the CPUs this process may run on)."""
    gpus = gpus_from_nvidia_smi()
    return Inventory(
        gpus=gpus if gpus_seen is None else gpus[:gpus_seen],
        cpus=float(len(os.sched_getaffinity(0))) if cpus is None else cpus,
        cpu=cpu_capabilities(),
    )
