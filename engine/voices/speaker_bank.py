"""Built-in voices: the speakers of a model's `spk2info.pt`, or seeded ones for dummy models.

`spk2info.pt` holds two kinds of entries, both written by the official code:
- SFT speakers (the files shipped with SFT models): `{'embedding': [1, D]}`;
- zero-shot speakers saved by `CosyVoice.add_zero_shot_spk` + `save_spkinfo`: the official zero-shot model
  input without the target text (`prompt_text`, `llm_prompt_speech_token`, `flow_prompt_speech_token`,
  `prompt_speech_feat`, `llm_embedding`, `flow_embedding` and their `*_len`). The official code uses them as
  `zero_shot_spk_id`: the stored prompt leads the request as in zero-shot cloning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from engine.errors import CheckpointError, UnknownVoiceError

DUMMY_VOICES = ("dummy_female", "dummy_male")


@dataclass(frozen=True)
class StoredPrompt:
    """A zero-shot speaker's prompt as the official frontend stored it (already tokenized and featurized)."""

    prompt_text_tokens: list[int]
    llm_embedding: np.ndarray  # float32 [D]
    flow_embedding: np.ndarray  # float32 [D]
    llm_speech_tokens: np.ndarray  # int64 [P]
    flow_speech_tokens: np.ndarray  # int64 [P']
    speech_feat: np.ndarray  # float32 [Tp, mel bins]


# spk2info key of each StoredPrompt field, and the rank of its tensor with the batch dim of 1 removed.
STORED_PROMPT_KEYS = {
    "prompt_text_tokens": ("prompt_text", 1),
    "llm_embedding": ("llm_embedding", 1),
    "flow_embedding": ("flow_embedding", 1),
    "llm_speech_tokens": ("llm_prompt_speech_token", 1),
    "flow_speech_tokens": ("flow_prompt_speech_token", 1),
    "speech_feat": ("prompt_speech_feat", 2),
}


def _stored_prompt(path: Path, name: str, entry: dict, embed_dim: int) -> StoredPrompt:
    values = {}
    for field_name, (key, rank) in STORED_PROMPT_KEYS.items():
        tensor = entry.get(key)
        if not isinstance(tensor, Tensor) or tensor.dim() != rank + 1 or tensor.shape[0] != 1:
            raise CheckpointError(
                f"speaker file {path}: entry {name!r} has neither 'embedding' nor a zero-shot prompt "
                f"({key!r} must be a tensor [1, ...] of {rank + 1} dims)"
            )
        values[field_name] = tensor[0].cpu()
    for field_name in ("llm_embedding", "flow_embedding"):
        if values[field_name].numel() != embed_dim:
            raise CheckpointError(f"speaker file {path}: entry {name!r} {field_name} is not {embed_dim}-dim")
        values[field_name] = values[field_name].float().numpy()
    for field_name in ("prompt_text_tokens", "llm_speech_tokens", "flow_speech_tokens"):
        if values[field_name].is_floating_point():
            raise CheckpointError(f"speaker file {path}: entry {name!r} {field_name} must hold integer ids")
    values["prompt_text_tokens"] = values["prompt_text_tokens"].tolist()
    values["llm_speech_tokens"] = values["llm_speech_tokens"].long().numpy()
    values["flow_speech_tokens"] = values["flow_speech_tokens"].long().numpy()
    values["speech_feat"] = values["speech_feat"].float().numpy()
    if len(values["flow_speech_tokens"]) and not len(values["speech_feat"]):
        raise CheckpointError(f"speaker file {path}: entry {name!r} has prompt speech tokens but no prompt mel")
    return StoredPrompt(**values)


class VoiceBank:
    """Speaker id -> 192-dim x-vector (SFT speakers), or -> a stored zero-shot prompt."""

    def __init__(self, embeddings: dict[str, Tensor], prompts: dict[str, StoredPrompt] | None = None) -> None:
        self._embeddings = embeddings
        self._prompts = prompts or {}

    @classmethod
    def from_spk2info(cls, path: Path, embed_dim: int) -> VoiceBank:
        """Read `spk2info.pt` (SFT and zero-shot entries, see the module docstring) with weights_only=True."""
        try:
            info = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"speaker file {path} cannot be loaded safely: {exc}") from exc
        if not isinstance(info, dict):
            raise CheckpointError(f"speaker file {path} is not a dict of speakers")
        embeddings, prompts = {}, {}
        for name, entry in info.items():
            if not isinstance(entry, dict):
                raise CheckpointError(f"speaker file {path}: entry {name!r} is not a dict")
            if "embedding" not in entry:
                prompts[str(name)] = _stored_prompt(path, str(name), entry, embed_dim)
                continue
            vector = entry["embedding"]
            if not isinstance(vector, Tensor) or vector.numel() != embed_dim:
                raise CheckpointError(f"speaker file {path}: entry {name!r} has no {embed_dim}-dim 'embedding'")
            embeddings[str(name)] = vector.reshape(embed_dim).float()
        return cls(embeddings, prompts)

    @classmethod
    def dummy(cls, embed_dim: int, seed: int = 0) -> VoiceBank:
        generator = torch.Generator().manual_seed(seed)
        return cls({name: torch.randn(embed_dim, generator=generator) for name in DUMMY_VOICES})

    @property
    def names(self) -> list[str]:
        return sorted([*self._embeddings, *self._prompts])

    def stored_prompt(self, voice: str) -> StoredPrompt | None:
        """The zero-shot prompt of a stored zero-shot speaker; None for an SFT speaker (or unknown voice)."""
        return self._prompts.get(voice)

    def embedding(self, voice: str) -> Tensor:
        """The speaker's x-vector [D] (a zero-shot speaker's flow embedding); UnknownVoiceError lists the voices."""
        if voice in self._prompts:
            return torch.from_numpy(self._prompts[voice].flow_embedding)
        if voice not in self._embeddings:
            known = ", ".join(self.names) or "none (this model has no built-in speakers)"
            raise UnknownVoiceError(f"unknown voice {voice!r}; available voices: {known}")
        return self._embeddings[voice]
