"""Registered (cloned) voices: `VoicePrompt`s kept on disk under ids like `voice_0123456789ab`.

Each voice is two files in one directory: `<id>.npz` (the prompt) and `<id>.json` (its record). The record
is written last and removed first, so a voice exists exactly while its record does. Every file is written
to a temporary name and renamed into place, so a reader never sees half a file. Several encoder replicas
may share the directory: a voice one of them added is found by the others (a cache miss looks on disk), and
one it deleted is gone for all of them (every lookup checks that the record still exists).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import time
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.errors import CosyVoiceError, InvalidInputError, UnknownVoiceError
from engine.voice_cloning import VoicePrompt

logger = logging.getLogger("ray.serve")

VOICE_ID_PATTERN = re.compile(r"voice_[0-9a-f]{12}")
MAX_VOICE_DISPLAY_NAME_CHARS = 64
DEFAULT_MAX_VOICES = 100


class VoiceRegistryFullError(CosyVoiceError):
    """The registry holds its maximum number of voices."""

    http_status = 409


@dataclass(frozen=True)
class VoiceRecord:
    """What the API shows of a registered voice (its prompt arrays stay on the encoder side)."""

    id: str
    name: str
    transcript: str
    duration_s: float
    created_at: int  # unix seconds, as in OpenAI's objects

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_voice_id(value: str) -> bool:
    """Whether `value` has the shape of a registered voice's id (the only names that ever reach the disk)."""
    return VOICE_ID_PATTERN.fullmatch(value) is not None


def display_name(name: str | None, voice_id: str) -> str:
    """The caller's name for the voice, stripped and bounded; the id when none is given."""
    if name is None or not name.strip():
        return voice_id
    name = name.strip()
    if len(name) > MAX_VOICE_DISPLAY_NAME_CHARS or any(unicodedata.category(char).startswith("C") for char in name):
        raise InvalidInputError(
            f"invalid voice name: at most {MAX_VOICE_DISPLAY_NAME_CHARS} characters, no control characters"
        )
    return name


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write` a temporary file beside `path` (same suffix, so savers that append one do not), then rename it."""
    temporary = path.with_name(f".{path.stem}.{secrets.token_hex(4)}.tmp{path.suffix}")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


class VoiceRegistry:
    """Voice id -> `VoicePrompt`, persisted under `directory`, at most `max_voices` of them."""

    def __init__(self, directory: Path, max_voices: int = DEFAULT_MAX_VOICES) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_voices = max_voices
        self._prompts: dict[str, VoicePrompt] = {}

    def _record_path(self, voice_id: str) -> Path:
        return self.directory / f"{voice_id}.json"

    def _prompt_path(self, voice_id: str) -> Path:
        return self.directory / f"{voice_id}.npz"

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Serialises adds and deletes across threads and processes (replicas) that share the directory."""
        with open(self.directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _voice_ids(self) -> list[str]:
        return sorted(path.stem for path in self.directory.glob("voice_*.json") if is_voice_id(path.stem))

    def add(self, prompt: VoicePrompt, name: str | None, duration_s: float) -> VoiceRecord:
        """Store `prompt` under a new id; VoiceRegistryFullError when `max_voices` are registered."""
        voice_id = f"voice_{secrets.token_hex(6)}"
        record = VoiceRecord(
            id=voice_id,
            name=display_name(name, voice_id),
            transcript=prompt.transcript,
            duration_s=round(duration_s, 3),
            created_at=int(time.time()),
        )
        with self._exclusive():
            if len(self._voice_ids()) >= self.max_voices:
                raise VoiceRegistryFullError(
                    f"the voice registry is full ({self.max_voices} voices); delete one (DELETE /v1/voices/<id>) first"
                )
            write_atomically(self._prompt_path(voice_id), prompt.save)
            write_atomically(self._record_path(voice_id), lambda path: path.write_text(json.dumps(record.as_dict())))
        self._prompts[voice_id] = prompt
        logger.info("registered voice %s (%.1f s of prompt audio)", voice_id, record.duration_s)
        return record

    def get(self, voice_id: str) -> VoicePrompt:
        """The prompt of a registered voice; UnknownVoiceError for any other name (never a file lookup)."""
        unknown = UnknownVoiceError(
            f"unknown voice {voice_id!r}: neither a built-in speaker nor a registered voice (GET /v1/voices lists both)"
        )
        if not is_voice_id(voice_id):
            raise unknown
        if not self._record_path(voice_id).exists():  # deleted, possibly by another replica
            self._prompts.pop(voice_id, None)
            raise unknown
        prompt = self._prompts.get(voice_id)
        if prompt is None:
            try:
                prompt = VoicePrompt.load(self._prompt_path(voice_id))
            except FileNotFoundError:  # deleted between the check and the load
                raise unknown from None
            self._prompts[voice_id] = prompt
        return prompt

    def records(self) -> list[VoiceRecord]:
        """Every registered voice, oldest first, ties by id (read from disk: it includes other replicas' voices)."""
        records = []
        for voice_id in self._voice_ids():
            try:
                records.append(VoiceRecord(**json.loads(self._record_path(voice_id).read_text())))
            except FileNotFoundError:  # deleted while listing
                continue
        return sorted(records, key=lambda record: (record.created_at, record.id))

    def delete(self, voice_id: str) -> bool:
        """Remove a voice; False when no such voice is registered."""
        if not is_voice_id(voice_id):
            return False
        with self._exclusive():
            self._prompts.pop(voice_id, None)
            try:
                self._record_path(voice_id).unlink()
            except FileNotFoundError:
                return False
            self._prompt_path(voice_id).unlink(missing_ok=True)
        logger.info("deleted voice %s", voice_id)
        return True
