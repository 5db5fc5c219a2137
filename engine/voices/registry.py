"""Registered (cloned) voices: `VoicePrompt`s kept on disk under ids like `voice_0123456789ab`.

Each voice is two files in one directory: `<id>.npz` (the prompt) and `<id>.json` (its record). The record
is written last and removed first, so a voice exists exactly while its record does. Every file is written
to a temporary name and renamed into place, so a reader never sees half a file. Several encoder replicas
may share the directory: a voice one of them added is found by the others (a cache miss looks on disk), and
one it deleted is gone for all of them (every lookup checks that the record still exists).

With API keys on, a voice belongs to the key that registered it (its record holds the key's owner id, never the
key): other keys neither see, use nor delete it. A record without an owner (made with keys off, by an admin as
shared, or written before owners existed) is shared: every key sees and uses it, only an admin key deletes it.
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
from engine.voices.cloning import VoicePrompt

logger = logging.getLogger("ray.serve")

VOICE_ID_PATTERN = re.compile(r"voice_[0-9a-f]{12}")
MAX_VOICE_DISPLAY_NAME_CHARS = 64
DEFAULT_MAX_VOICES = 100
DEFAULT_MAX_VOICES_PER_KEY = 20


class VoiceRegistryFullError(CosyVoiceError):
    """The registry holds its maximum number of voices."""

    http_status = 409


class VoiceForbiddenError(CosyVoiceError):
    """A key asked for what only an admin key may do to a voice it can see (delete a shared one, make one shared)."""

    http_status = 403


@dataclass(frozen=True)
class Caller:
    """Who asks the registry: the owner id of their API key (None with keys off) and whether it is an admin key."""

    owner: str | None
    admin: bool

    def sees(self, owner: str | None) -> bool:
        """Whether a voice owned by `owner` (None: shared) exists for this caller: listed and usable."""
        return self.admin or owner is None or owner == self.owner

    def may_delete(self, owner: str | None) -> bool:
        return self.admin or (owner is not None and owner == self.owner)


# With keys off there is no owner: every voice is shared and anyone may delete any (as before keys had owners).
EVERYONE = Caller(owner=None, admin=True)


@dataclass(frozen=True)
class VoiceRecord:
    """A registered voice's record: what the API shows of it (`shown`) and its owner (its prompt arrays stay on the
    encoder side)."""

    id: str
    name: str
    transcript: str
    duration_s: float
    created_at: int  # unix seconds, as in OpenAI's objects
    owner: str | None = None  # the owner id of the key that registered it; None: shared (and every older record)

    def as_dict(self) -> dict[str, Any]:
        """The record as stored."""
        return asdict(self)

    def shown(self) -> dict[str, Any]:
        """The record as the API shows it: whether it is shared instead of whose it is."""
        shown = self.as_dict()
        shown["shared"] = shown.pop("owner") is None
        return shown


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
    """Voice id -> `VoicePrompt`, persisted under `directory`, at most `max_voices` of them and `max_voices_per_key`
    of one key's (None: no bound per key; shared voices count only towards `max_voices`)."""

    def __init__(
        self,
        directory: Path,
        max_voices: int = DEFAULT_MAX_VOICES,
        max_voices_per_key: int | None = DEFAULT_MAX_VOICES_PER_KEY,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_voices = max_voices
        self.max_voices_per_key = max_voices_per_key
        self._prompts: dict[str, VoicePrompt] = {}
        self._owners: dict[str, str | None] = {}  # an id's owner never changes (ids are never reused)

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

    def _read_record(self, voice_id: str) -> VoiceRecord | None:
        try:
            return VoiceRecord(**json.loads(self._record_path(voice_id).read_text()))
        except FileNotFoundError:  # deleted, possibly by another replica
            return None

    def _visible(self, voice_id: str, caller: Caller) -> bool:
        """Whether the voice exists (its record, checked on every call: another replica may have deleted it) and
        `caller` sees it; its owner is read once."""
        if not self._record_path(voice_id).exists():
            self._prompts.pop(voice_id, None)
            self._owners.pop(voice_id, None)
            return False
        if voice_id not in self._owners:
            record = self._read_record(voice_id)
            if record is None:  # deleted since the check
                return False
            self._owners[voice_id] = record.owner
        return caller.sees(self._owners[voice_id])

    def add(
        self, prompt: VoicePrompt, name: str | None, duration_s: float, caller: Caller, shared: bool = False
    ) -> VoiceRecord:
        """Store `prompt` under a new id, owned by `caller` (or by nobody: `shared`, an admin's choice);
        VoiceRegistryFullError when `max_voices` are registered, or `max_voices_per_key` of the owner's."""
        if shared and not caller.admin:
            raise VoiceForbiddenError("only an admin key may register a shared voice")
        voice_id = f"voice_{secrets.token_hex(6)}"
        record = VoiceRecord(
            id=voice_id,
            name=display_name(name, voice_id),
            transcript=prompt.transcript,
            duration_s=round(duration_s, 3),
            created_at=int(time.time()),
            owner=None if shared else caller.owner,
        )
        with self._exclusive():
            voice_ids = self._voice_ids()
            if len(voice_ids) >= self.max_voices:
                raise VoiceRegistryFullError(
                    f"the voice registry is full ({self.max_voices} voices); delete one (DELETE /v1/voices/<id>) first"
                )
            if record.owner is not None and self.max_voices_per_key is not None:
                records = (self._read_record(existing_id) for existing_id in voice_ids)
                owned = sum(1 for existing in records if existing is not None and existing.owner == record.owner)
                if owned >= self.max_voices_per_key:
                    raise VoiceRegistryFullError(
                        f"this API key has registered {owned} voices, the limit; delete one (DELETE /v1/voices/<id>) "
                        "first"
                    )
            write_atomically(self._prompt_path(voice_id), prompt.save)
            write_atomically(self._record_path(voice_id), lambda path: path.write_text(json.dumps(record.as_dict())))
        self._prompts[voice_id] = prompt
        self._owners[voice_id] = record.owner
        logger.info("registered voice %s (%.1f s of prompt audio)", voice_id, record.duration_s)
        return record

    def get(self, voice_id: str, caller: Caller) -> VoicePrompt:
        """The prompt of a registered voice `caller` sees; UnknownVoiceError for any other name (never a file
        lookup), the same for another key's voice as for one that does not exist."""
        unknown = UnknownVoiceError(
            f"unknown voice {voice_id!r}: neither a built-in speaker nor a registered voice (GET /v1/voices lists both)"
        )
        if not is_voice_id(voice_id) or not self._visible(voice_id, caller):
            raise unknown
        prompt = self._prompts.get(voice_id)
        if prompt is None:
            try:
                prompt = VoicePrompt.load(self._prompt_path(voice_id))
            except FileNotFoundError:  # deleted between the check and the load
                raise unknown from None
            self._prompts[voice_id] = prompt
        return prompt

    def records(self, caller: Caller) -> list[VoiceRecord]:
        """Every registered voice `caller` sees, oldest first, ties by id (read from disk: it includes other
        replicas' voices)."""
        records = [record for voice_id in self._voice_ids() if (record := self._read_record(voice_id)) is not None]
        visible = [record for record in records if caller.sees(record.owner)]
        return sorted(visible, key=lambda record: (record.created_at, record.id))

    def delete(self, voice_id: str, caller: Caller) -> bool:
        """Remove a voice; False when `caller` sees no such voice, VoiceForbiddenError when it sees it but only an
        admin key may delete it (a shared voice)."""
        if not is_voice_id(voice_id):
            return False
        with self._exclusive():
            record = self._read_record(voice_id)
            if record is None or not caller.sees(record.owner):
                return False
            if not caller.may_delete(record.owner):
                raise VoiceForbiddenError(f"voice {voice_id!r} is shared: only an admin key may delete it")
            self._prompts.pop(voice_id, None)
            self._owners.pop(voice_id, None)
            self._record_path(voice_id).unlink()
            self._prompt_path(voice_id).unlink(missing_ok=True)
        logger.info("deleted voice %s", voice_id)
        return True
