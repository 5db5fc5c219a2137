"""Request checks in front of the HTTP API: bearer API keys, the request body size, safe voice names.

`RequestGuard` is a plain ASGI middleware on the ingress's FastAPI app. The app object is frozen into the
deployment when the module is imported, so its settings cannot be passed at construction: each ingress
replica (one per process) installs them with `configure_guard` from its `__init__`.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import unicodedata
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidInputError
from serve_app.args import SecurityArgs

logger = logging.getLogger("ray.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ErrorBody = Callable[[int, str, str], dict[str, Any]]

# Probes, and the try-it page with its script and style (no data in them; the page asks for a key itself).
OPEN_PATHS = frozenset({"/healthz", "/"})
OPEN_PREFIXES = ("/static/",)
MAX_VOICE_NAME_CHARS = 128


@dataclass(frozen=True)
class GuardSettings:
    api_keys: tuple[bytes, ...]  # empty: no authentication
    max_body_bytes: int
    # Paths whose bodies may be larger than `max_body_bytes` (uploads), and their own limit.
    body_limits_by_path: Mapping[str, int] = field(default_factory=dict)

    def body_limit(self, path: str) -> int:
        return self.body_limits_by_path.get(path, self.max_body_bytes)


_settings: GuardSettings | None = None


def configure_guard(settings: GuardSettings | None) -> None:
    """Install this process's settings; None turns the guard off."""
    global _settings
    _settings = settings


def load_api_keys(security: SecurityArgs, environ: MutableMapping[str, str] = os.environ) -> tuple[bytes, ...]:
    """The configured keys plus the comma-separated ones of `security.api_keys_env` in this process."""
    keys = [key.get_secret_value() for key in security.api_keys]
    if security.api_keys_env:
        keys += environ.get(security.api_keys_env, "").split(",")
    return tuple(key.strip().encode() for key in keys if key.strip())


def is_open(path: str) -> bool:
    """Whether `path` (the app's own, without the route prefix) is served without an API key."""
    return path in OPEN_PATHS or path == "" or path.startswith(OPEN_PREFIXES)


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def key_is_valid(token: bytes | None, keys: tuple[bytes, ...]) -> bool:
    """Constant-time comparison against every key (no early exit that would tell which one came close)."""
    if token is None:
        return False
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched


def check_voice_name(voice: str) -> None:
    """Voice names are ids, never paths: no separators, no '..', no control characters (400 otherwise)."""
    unsafe = (
        not voice
        or len(voice) > MAX_VOICE_NAME_CHARS
        or "/" in voice
        or "\\" in voice
        or voice in (".", "..")
        or any(unicodedata.category(char).startswith("C") for char in voice)
    )
    if unsafe:
        raise InvalidInputError(
            f"invalid voice name: at most {MAX_VOICE_NAME_CHARS} characters, no path separators, '..' or control "
            "characters"
        )


class RequestGuard:
    """401 without a valid bearer key (when keys are configured; /healthz and the page are open), 413 for a body
    over the limit."""

    def __init__(self, app: ASGIApp, error_body: ErrorBody) -> None:
        self.app = app
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings = _settings
        if scope["type"] != "http" or settings is None:
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        # The app's own path: under a Serve route prefix, `path` starts with it (it is also the `root_path`).
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if settings.api_keys and not is_open(path) and not key_is_valid(bearer_token(headers), settings.api_keys):
            logger.warning("rejected %s %s: missing or invalid API key", scope["method"], scope["path"])
            await self.reply(
                send, 401, "missing or invalid API key (send `Authorization: Bearer <key>`)", "invalid_api_key"
            )
            return
        limit = settings.body_limit(path)
        body = await read_body_within(receive, headers, limit)
        if body is None:
            await self.reply(send, 413, f"the request body is larger than {limit} bytes", "body_too_large")
            return
        await self.app(scope, replay_body(body, receive), send)

    async def reply(self, send: Send, status: int, message: str, code: str) -> None:
        content = json.dumps(self.error_body(status, message, code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})


async def read_body_within(receive: Receive, headers: list[tuple[bytes, bytes]], limit: int) -> bytes | None:
    """The whole body (API bodies are small JSON), or None as soon as it is known to exceed `limit` bytes."""
    for name, value in headers:
        if name.lower() == b"content-length" and value.isdigit() and int(value) > limit:
            return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left; nobody reads the answer
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands out the buffered body once, then the real channel (disconnects included)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
