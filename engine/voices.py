"""Built-in voices: the speakers of an SFT model's `spk2info.pt`, or seeded ones for dummy models."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from engine.errors import CheckpointError, UnknownVoiceError

DUMMY_VOICES = ("dummy_female", "dummy_male")


class VoiceBank:
    """Speaker id -> 192-dim x-vector, as in the official `spk2info.pt`."""

    def __init__(self, embeddings: dict[str, Tensor]) -> None:
        self._embeddings = embeddings

    @classmethod
    def from_spk2info(cls, path: Path, embed_dim: int) -> VoiceBank:
        """Read `spk2info.pt` ({speaker: {'embedding': [1, D]}}) with weights_only=True."""
        try:
            info = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"speaker file {path} cannot be loaded safely: {exc}") from exc
        if not isinstance(info, dict):
            raise CheckpointError(f"speaker file {path} is not a dict of speakers")
        embeddings = {}
        for name, entry in info.items():
            vector = entry.get("embedding") if isinstance(entry, dict) else None
            if not isinstance(vector, Tensor) or vector.numel() != embed_dim:
                raise CheckpointError(f"speaker file {path}: entry {name!r} has no {embed_dim}-dim 'embedding'")
            embeddings[str(name)] = vector.reshape(embed_dim).float()
        return cls(embeddings)

    @classmethod
    def dummy(cls, embed_dim: int, seed: int = 0) -> VoiceBank:
        generator = torch.Generator().manual_seed(seed)
        return cls({name: torch.randn(embed_dim, generator=generator) for name in DUMMY_VOICES})

    @property
    def names(self) -> list[str]:
        return sorted(self._embeddings)

    def embedding(self, voice: str) -> Tensor:
        """The speaker's x-vector [D]; UnknownVoiceError lists the known voices."""
        if voice not in self._embeddings:
            known = ", ".join(self.names) or "none (this model has no built-in speakers)"
            raise UnknownVoiceError(f"unknown voice {voice!r}; available voices: {known}")
        return self._embeddings[voice]
