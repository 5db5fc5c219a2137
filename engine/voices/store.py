"""Where registered voices are kept: a local directory, or an object store (`s3://bucket/prefix`) through fsspec.

A store holds two objects per voice, `<id>.npz` (the prompt) and `<id>.json` (its record), and offers what the
registry needs of them: whole-object writes that a reader never sees half done, the record's version (to revalidate
a cached prompt), a listing, removal, and mutual exclusion for the registry's bounds.

* `LocalStore`: a directory; writes go to a temporary name, then a rename; an `fcntl` lock on `.lock` serialises
  adds and deletes; a record's version is its modification time and size.
* `ObjectStore`: any fsspec URL (`s3://` needs s3fs, the `s3` extra); a PUT is all or nothing; mutual exclusion is a
  lease, the lock object `.lock` created with a conditional PUT (`If-None-Match: *`) and broken when older than
  `LOCK_LEASE_S`; a record's version is its ETag. Credentials come from the environment, never from app args
  (docs/voices.md).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from engine.errors import CosyVoiceError

URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
LOCK_NAME = ".lock"
LOCK_LEASE_S = 30.0  # an add or delete holds the lock for a listing and a few small requests: well under a second
LOCK_WAIT_S = 60.0  # past this, the registry answers 503 (the store is too slow or too contended)


class VoiceStoreError(CosyVoiceError):
    """The voices store cannot be opened (a URL whose filesystem package is missing)."""


class VoiceStoreBusyError(CosyVoiceError):
    """The voice store's lock could not be taken in time."""

    http_status = 503


def is_store_url(location: str) -> bool:
    """Whether `location` is a URL (`s3://...`) rather than a local path (`file://` counts as a path)."""
    return URL_SCHEME.match(location) is not None and not location.startswith("file://")


def open_store(location: str | Path) -> LocalStore | ObjectStore:
    """The store of `location`: a local path (or `file://` URL) or an fsspec URL."""
    location = str(location)
    if is_store_url(location):
        return ObjectStore(location)
    return LocalStore(Path(location.removeprefix("file://")))


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write` a temporary file beside `path` (same suffix, so savers that append one do not), then rename it."""
    temporary = path.with_name(f".{path.stem}.{secrets.token_hex(4)}.tmp{path.suffix}")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


class LocalStore:
    """Voices in a local directory (created if missing)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.location = str(self.directory)

    def path(self, name: str) -> Path:
        return self.directory / name

    def names(self, pattern: str) -> list[str]:
        """The names of the objects matching a glob `pattern`."""
        return [path.name for path in self.directory.glob(pattern)]

    def read(self, name: str) -> bytes:
        """The object's bytes; FileNotFoundError when it does not exist."""
        return self.path(name).read_bytes()

    def read_many(self, names: list[str]) -> dict[str, bytes]:
        """The bytes of each object of `names` that exists."""
        found = {}
        for name in names:
            with suppress(FileNotFoundError):
                found[name] = self.read(name)
        return found

    def version(self, name: str) -> str | None:
        """What changes whenever the object is rewritten; None when it does not exist."""
        try:
            stat = self.path(name).stat()
        except FileNotFoundError:
            return None
        return f"{stat.st_mtime_ns}-{stat.st_size}"

    def write(self, name: str, data: bytes) -> None:
        """Replace the object whole: a reader sees the old bytes or the new ones."""
        write_atomically(self.path(name), lambda path: _write_synced(path, data))

    def remove(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Serialises adds and deletes across threads and processes (replicas) that share the directory."""
        with open(self.directory / LOCK_NAME, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


class ObjectStore:
    """Voices under an fsspec URL, such as `s3://bucket/prefix`."""

    def __init__(self, url: str, lease_s: float = LOCK_LEASE_S, wait_s: float = LOCK_WAIT_S) -> None:
        import fsspec  # the local path needs none of it

        # Listings are never cached: another replica may add or delete a voice at any time.
        options: dict[str, Any] = {
            "skip_instance_cache": True
        }  # each replica its own client, of the current environment
        if url.startswith(("s3://", "s3a://")):
            options["use_listings_cache"] = False
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except ImportError as error:  # fsspec names the package it lacks (s3fs for s3://)
            raise VoiceStoreError(
                f"voices_dir {url}: {error} (for s3://: pip install 'cosyvoice-serve[s3]' on every node)"
            ) from None
        self.root = root.rstrip("/")
        self.location = url
        self.lease_s = lease_s
        self.wait_s = wait_s
        try:  # at start, where a wrong bucket, endpoint or credential is the operator's to see
            self.names("voice_*.json")
        except Exception as error:  # whatever the filesystem package raises for it
            raise VoiceStoreError(f"voices_dir {url} cannot be listed (the bucket must exist): {error}") from error

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def names(self, pattern: str) -> list[str]:
        self.fs.invalidate_cache(self.root)
        return [path.rsplit("/", 1)[-1] for path in self.fs.glob(self.path(pattern))]

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self.path(name))

    def read_many(self, names: list[str]) -> dict[str, bytes]:
        """The bytes of each object of `names` that exists, fetched concurrently (s3fs batches the GETs)."""
        if not names:
            return {}
        found = self.fs.cat([self.path(name) for name in names], on_error="omit")
        return {path.rsplit("/", 1)[-1]: data for path, data in found.items()}

    def version(self, name: str) -> str | None:
        self.fs.invalidate_cache(self.path(name))
        try:
            info = self.fs.info(self.path(name))
        except FileNotFoundError:
            return None
        tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
        return f"{tag}-{info.get('size')}"

    def write(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(name), data)  # one PUT: all or nothing

    def remove(self, name: str) -> None:
        with suppress(FileNotFoundError):
            self.fs.rm_file(self.path(name))

    def _try_lock(self, token: bytes) -> bool:
        try:
            self.fs.pipe_file(self.path(LOCK_NAME), token, mode="create")
        except (FileExistsError, OSError):  # s3fs reports the 412 of a conditional PUT as an OSError
            return False
        return True

    def _break_abandoned_lock(self) -> None:
        """Remove the lock object if its lease ran out (its holder died while holding it)."""
        try:
            lease = json.loads(self.read(LOCK_NAME))
        except (FileNotFoundError, ValueError):
            return
        if time.time() - float(lease.get("at", 0)) > self.lease_s:
            self.remove(LOCK_NAME)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """A lease on the lock object, for as long as the block runs; VoiceStoreBusyError after `wait_s`."""
        deadline = time.monotonic() + self.wait_s
        pause = 0.02
        while not self._try_lock(token := json.dumps({"token": secrets.token_hex(8), "at": time.time()}).encode()):
            if time.monotonic() > deadline:
                raise VoiceStoreBusyError(
                    f"the voice store {self.location} is busy (its lock was held for {self.wait_s:g} s); retry"
                )
            self._break_abandoned_lock()
            time.sleep(pause + secrets.randbelow(20) / 1000)
            pause = min(pause * 2, 0.5)
        try:
            yield
        finally:
            with suppress(FileNotFoundError):
                if self.read(LOCK_NAME) == token:  # still ours (not broken as abandoned and taken by another)
                    self.remove(LOCK_NAME)
