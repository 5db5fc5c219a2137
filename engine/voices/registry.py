"""Registered (cloned) voices: `VoicePrompt`s kept in a store under ids like `voice_0123456789ab`.

Each voice is two objects in one store (engine.voices.store): `<id>.npz` (the prompt) and `<id>.json` (its record).
The prompt is written first and the record last, the record removed first and the prompt after, so a voice exists
exactly while its record does; a reader reads the record first. Several encoder replicas may share the store: every
lookup checks the record's version, so a voice added or deleted by one replica is seen by all, and adds and deletes
hold the store's lock, so the bounds hold across replicas (docs/voices.md, "What holds, on either store").

With API keys on, a voice belongs to the key that registered it (its record holds the key's owner id, never the
key): other keys neither see, use nor delete it. A record without an owner is shared: every key sees and uses it,
only an admin key deletes it (docs/security.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import time
import unicodedata
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.errors import CosyVoiceError, InvalidInputError, UnknownVoiceError
from engine.voices.cloning import VoicePrompt
from engine.voices.store import LocalStore, ObjectStore, open_store

logger = logging.getLogger("ray.serve")

VOICE_ID_PATTERN = re.compile(r"voice_[0-9a-f]{12}")
OPENAI_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,31}")
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
    source: str | None = None  # a voice provisioned at deploy: the digest of its audio and transcript
    openai_name: str | None = None  # a name OpenAI clients may send as `voice` for it (registered with it)

    def as_dict(self) -> dict[str, Any]:
        """The record as stored (`source` and `openai_name` only where there are some)."""
        stored = asdict(self)
        for optional in ("source", "openai_name"):
            if stored[optional] is None:
                del stored[optional]
        return stored

    def shown(self) -> dict[str, Any]:
        """The record as the API shows it: whether it is shared instead of whose it is."""
        shown = self.as_dict()
        shown.pop("source", None)
        shown["shared"] = shown.pop("owner") is None
        return shown


def is_voice_id(value: str) -> bool:
    """Whether `value` has the shape of a registered voice's id (the only names that ever reach the disk)."""
    return VOICE_ID_PATTERN.fullmatch(value) is not None


def provisioned_voice_id(name: str) -> str:
    """The registry id of a voice provisioned at deploy under the operator's `name`: the name itself when it has the
    shape of a voice id, else one derived from it (the same name, the same id, on every replica and every start)."""
    if is_voice_id(name):
        return name
    return f"voice_{hashlib.sha256(f'provisioned:{name}'.encode()).hexdigest()[:12]}"


def checked_openai_name(name: str | None) -> str | None:
    """A voice name as OpenAI clients send it (`alloy`, `narrator-2`): lowercase, at most 32 characters; None: none."""
    if name is None or not name.strip():
        return None
    if OPENAI_NAME_PATTERN.fullmatch(name) is None or is_voice_id(name):
        raise InvalidInputError(
            "invalid openai_name: a lowercase letter, then up to 31 lowercase letters, digits, '-' or '_'"
        )
    return name


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


def check_choices(name: str | None, caller: Caller, shared: bool, openai_name: str | None) -> None:
    """What a caller chooses for a voice it registers, checked: InvalidInputError for a display or OpenAI name that
    cannot be one, VoiceForbiddenError for a shared voice asked for by a key that is not an admin's."""
    if shared and not caller.admin:
        raise VoiceForbiddenError("only an admin key may register a shared voice")
    display_name(name, "")
    checked_openai_name(openai_name)


@dataclass
class _Cached:
    """What a replica keeps of a voice: the version of the record it read, the owner, the prompt once loaded."""

    version: str
    owner: str | None
    prompt: VoicePrompt | None = None


class VoiceRegistry:
    """Voice id -> `VoicePrompt`, persisted under `location` (a directory, or an object-store URL such as
    `s3://bucket/prefix`), at most `max_voices` of them and `max_voices_per_key` of one key's (None: no bound per
    key; shared voices count only towards `max_voices`)."""

    def __init__(
        self,
        location: Path | str,
        max_voices: int = DEFAULT_MAX_VOICES,
        max_voices_per_key: int | None = DEFAULT_MAX_VOICES_PER_KEY,
    ) -> None:
        self.store: LocalStore | ObjectStore = open_store(location)
        self.max_voices = max_voices
        self.max_voices_per_key = max_voices_per_key
        self._cache: dict[str, _Cached] = {}

    @property
    def location(self) -> str:
        return self.store.location

    def _voice_ids(self) -> list[str]:
        return sorted(
            stem for name in self.store.names("voice_*.json") if is_voice_id(stem := name.removesuffix(".json"))
        )

    def _read_record(self, voice_id: str) -> VoiceRecord | None:
        try:
            return VoiceRecord(**json.loads(self.store.read(f"{voice_id}.json")))
        except FileNotFoundError:  # deleted, possibly by another replica
            return None

    def _read_records(self, voice_ids: list[str]) -> list[VoiceRecord]:
        """The records of those of `voice_ids` that still exist (read together: concurrently on an object store)."""
        found = self.store.read_many([f"{voice_id}.json" for voice_id in voice_ids])
        return [VoiceRecord(**json.loads(data)) for data in found.values()]

    def _load_prompt(self, voice_id: str) -> VoicePrompt:
        """The stored prompt; FileNotFoundError when it is gone."""
        if isinstance(self.store, LocalStore):
            return VoicePrompt.load(self.store.path(f"{voice_id}.npz"))
        return VoicePrompt.from_bytes(self.store.read(f"{voice_id}.npz"), f"{self.location}/{voice_id}.npz")

    def _write(self, prompt: VoicePrompt, record: VoiceRecord) -> None:
        """The prompt first, the record last: the voice exists once its record does, whole."""
        self.store.write(f"{record.id}.npz", prompt.to_bytes())
        self.store.write(f"{record.id}.json", json.dumps(record.as_dict()).encode())

    def _current(self, voice_id: str) -> _Cached | None:
        """The cache entry of a voice that exists, checked against its record's version on every call (another
        replica may have deleted or replaced it); None when it does not exist."""
        version = self.store.version(f"{voice_id}.json")
        if version is None:
            self._cache.pop(voice_id, None)
            return None
        cached = self._cache.get(voice_id)
        if cached is None or cached.version != version:
            record = self._read_record(voice_id)
            if record is None:  # deleted since the check
                self._cache.pop(voice_id, None)
                return None
            cached = self._cache[voice_id] = _Cached(version, record.owner)
        return cached

    def add(
        self,
        prompt: VoicePrompt,
        name: str | None,
        duration_s: float,
        caller: Caller,
        shared: bool = False,
        openai_name: str | None = None,
    ) -> VoiceRecord:
        """Store `prompt` under a new id, owned by `caller` (or by nobody: `shared`, an admin's choice), with the
        `openai_name` clients may send for it; VoiceRegistryFullError when `max_voices` are registered, or
        `max_voices_per_key` of the owner's."""
        check_choices(name, caller, shared, openai_name)
        voice_id = f"voice_{secrets.token_hex(6)}"
        record = VoiceRecord(
            id=voice_id,
            name=display_name(name, voice_id),
            transcript=prompt.transcript,
            duration_s=round(duration_s, 3),
            created_at=int(time.time()),
            owner=None if shared else caller.owner,
            openai_name=checked_openai_name(openai_name),
        )
        with self.store.exclusive():
            self._check_room(record.owner)
            self._write(prompt, record)
        logger.info("registered voice %s (%.1f s of prompt audio)", voice_id, record.duration_s)
        return record

    def check_admission(self, name: str | None, caller: Caller, shared: bool, openai_name: str | None) -> None:
        """What `add` would refuse (the caller's choices, no room left), checked without the store's lock: so that a
        registration it refuses is refused before its recording is decoded and cloned (`add` checks again, under the
        lock)."""
        check_choices(name, caller, shared, openai_name)
        self._check_room(None if shared else caller.owner)

    def _check_room(self, owner: str | None) -> None:
        """VoiceRegistryFullError when `max_voices` are registered, or `max_voices_per_key` of `owner`'s (None:
        shared, outside that bound)."""
        voice_ids = self._voice_ids()
        if len(voice_ids) >= self.max_voices:
            raise VoiceRegistryFullError(
                f"the voice registry is full ({self.max_voices} voices); delete one (DELETE /v1/voices/<id>) first"
            )
        if owner is not None and self.max_voices_per_key is not None:
            owned = sum(1 for existing in self._read_records(voice_ids) if existing.owner == owner)
            if owned >= self.max_voices_per_key:
                raise VoiceRegistryFullError(
                    f"this API key has registered {owned} voices, the limit; delete one (DELETE /v1/voices/<id>) first"
                )

    def provision(
        self, voice_id: str, name: str | None, source: str, clone: Callable[[], tuple[VoicePrompt, float]]
    ) -> VoiceRecord:
        """A voice the operator provisions at deploy, under its fixed id, shared, outside the bounds: registered
        once whatever the number of replicas that start together (the same `source`, a digest of its audio and
        transcript, is the same voice: nothing is cloned), replaced when its source changed. `clone()` makes the
        prompt and gives its duration."""
        if not is_voice_id(voice_id):
            raise InvalidInputError(f"invalid provisioned voice id {voice_id!r}")
        existing = self._read_record(voice_id)
        if existing is not None and existing.source == source:
            return existing
        prompt, duration_s = clone()  # outside the lock: it takes a while
        record = VoiceRecord(
            id=voice_id,
            name=display_name(name, voice_id),
            transcript=prompt.transcript,
            duration_s=round(duration_s, 3),
            created_at=int(time.time()),
            source=source,
        )
        with self.store.exclusive():
            existing = self._read_record(voice_id)
            if existing is not None and existing.source == source:  # another replica was first
                return existing
            self._write(prompt, record)
        logger.info("provisioned voice %s (%s)", voice_id, "replaced" if existing is not None else "new")
        return record

    def get(self, voice_id: str, caller: Caller) -> VoicePrompt:
        """The prompt of a registered voice `caller` sees; UnknownVoiceError for any other name (never a file
        lookup), the same for another key's voice as for one that does not exist."""
        unknown = UnknownVoiceError(
            f"unknown voice {voice_id!r}: neither a built-in speaker nor a registered voice (GET /v1/voices lists both)"
        )
        cached = self._current(voice_id) if is_voice_id(voice_id) else None
        if cached is None or not caller.sees(cached.owner):
            raise unknown
        if cached.prompt is None:
            try:
                cached.prompt = self._load_prompt(voice_id)
            except FileNotFoundError:  # deleted between the check and the load
                raise unknown from None
        return cached.prompt

    def records(self, caller: Caller) -> list[VoiceRecord]:
        """Every registered voice `caller` sees, oldest first, ties by id (read from the store: it includes other
        replicas' voices)."""
        visible = [record for record in self._read_records(self._voice_ids()) if caller.sees(record.owner)]
        return sorted(visible, key=lambda record: (record.created_at, record.id))

    def named(self, openai_name: str, caller: Caller) -> str | None:
        """The id of the voice `caller` hears for `openai_name`: the newest of its own registered with that name, else
        the newest shared one; never another key's, though an admin sees them all, so that no key changes what another
        hears for a name. None when there is none."""
        matches = [record for record in self.records(caller) if record.openai_name == openai_name]  # oldest first
        for owner in (caller.owner, None):
            owned = [record for record in matches if record.owner == owner]
            if owned:
                return owned[-1].id
        return None

    def delete(self, voice_id: str, caller: Caller) -> bool:
        """Remove a voice; False when `caller` sees no such voice, VoiceForbiddenError when it sees it but only an
        admin key may delete it (a shared voice)."""
        if not is_voice_id(voice_id):
            return False
        with self.store.exclusive():
            record = self._read_record(voice_id)
            if record is None or not caller.sees(record.owner):
                return False
            if not caller.may_delete(record.owner):
                raise VoiceForbiddenError(f"voice {voice_id!r} is shared: only an admin key may delete it")
            self._cache.pop(voice_id, None)
            self.store.remove(f"{voice_id}.json")  # the record first: from here the voice does not exist
            self.store.remove(f"{voice_id}.npz")
        logger.info("deleted voice %s", voice_id)
        return True
