"""Strict, safe loading of the official checkpoint files, with errors that name the file and keys."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.errors import CheckpointError

_MAX_KEYS_LISTED = 12


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """`torch.load(weights_only=True)` of a state dict; anything else is a CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt or unsafe pickles
        raise CheckpointError(f"checkpoint file {path} cannot be loaded safely: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"checkpoint file {path} is not a state dict of tensors")
    return state


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_KEYS_LISTED])
    more = len(keys) - _MAX_KEYS_LISTED
    return shown + (f" (+{more} more)" if more > 0 else "")


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """Load `state` into `module` requiring the exact same keys and shapes.

    Raises CheckpointError listing missing, unexpected and mis-shaped keys, naming `source`.
    """
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    misshaped = [
        f"{k} (file {tuple(state[k].shape)}, model {tuple(expected[k].shape)})"
        for k in expected
        if k in state and state[k].shape != expected[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listed(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped keys: {_listed(misshaped)}")
    if problems:
        raise CheckpointError(f"checkpoint {source} does not match its config: " + "; ".join(problems))
    module.load_state_dict(state, strict=True)
