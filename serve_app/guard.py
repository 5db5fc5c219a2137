"""Request checks in front of the HTTP API: bearer API keys, the request body size and read time, the Host and
Origin of browser requests, safe voice names.

`RequestGuard` is a plain ASGI middleware on the ingress's FastAPI app, which each ingress replica builds with its
settings (`serve_app.api.build_api`); the browser rules it applies are `serve_app.browser_rules`'.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import os
import unicodedata
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from engine.errors import InvalidInputError
from serve_app.browser_rules import WEBSOCKET, BrowserRules, header
from serve_app.exposure import is_loopback
from serve_app.request_args import ADMIN_KEYS_ENV, API_KEYS_ENV, SecurityArgs

logger = logging.getLogger("ray.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ErrorBody = Callable[[int, str, str], dict[str, Any]]
Headers = list[tuple[bytes, bytes]]

# Probes, and the try-it page with its script and style (no data in them; the page asks for a key itself).
OPEN_PATHS = frozenset({"/healthz", "/", "/favicon.ico"})
OPEN_PREFIXES = ("/static/",)
MAX_VOICE_NAME_CHARS = 128

# A browser's WebSocket cannot send an Authorization header: it may offer the key as a subprotocol instead, this
# prefix and the key in unpadded base64url (Kubernetes does the same), next to `WEBSOCKET_PROTOCOL`, which the
# server accepts.
WEBSOCKET_PROTOCOL = "cosyvoice-tts"
WEBSOCKET_KEY_PROTOCOL_PREFIX = "cosyvoice-tts.bearer."


class BodyReadTimeoutError(Exception):
    """The client stopped sending its request body (answered 408, and the connection is closed)."""


# How long the guard waits for a request body: a client that stalls longer gets 408 and its connection is closed,
# freeing its ingress slot; one that trickles its body in is bounded by the whole body's deadline. A body is at most
# a 10 MiB voice upload, which arrives within 120 s at 0.7 Mbit/s.
BODY_READ_IDLE_S = 10.0
BODY_READ_DEADLINE_S = 120.0


@dataclass(frozen=True)
class BodyTimeouts:
    """How long the guard waits for a request body (the tests pass shorter ones)."""

    idle_s: float = BODY_READ_IDLE_S  # the longest wait for the next piece
    total_s: float = BODY_READ_DEADLINE_S  # the whole body

    def bound(self, receive: Receive) -> Receive:
        """`receive` that raises BodyReadTimeoutError past either limit (the clock starts now)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_s

        async def timed() -> Message:
            wait_s = min(self.idle_s, deadline - loop.time())
            try:
                return await asyncio.wait_for(receive(), max(wait_s, 0.0))
            except asyncio.TimeoutError:  # on Python 3.10 not the built-in TimeoutError
                raise BodyReadTimeoutError(
                    f"the request body did not arrive in time (a pause over {self.idle_s:g} s, or over "
                    f"{self.total_s:g} s in all)"
                ) from None

        return timed


def serving_warnings(security: SecurityArgs, bound_host: str | None, has_keys: bool) -> tuple[str, ...]:
    """What is unsafe in how the server runs: serving beyond loopback without API keys."""
    if has_keys or bound_host is None or is_loopback(bound_host):
        return ()
    return (
        f"serving HTTP on {bound_host}, beyond loopback, without API keys: anyone who can reach the port can "
        f"synthesize and register or delete voices; set security.api_keys or the {API_KEYS_ENV} environment variable "
        "of the ingress replicas",
    )


@dataclass(frozen=True)
class GuardSettings:
    api_keys: tuple[bytes, ...]  # empty: no authentication
    max_body_bytes: int
    # Paths whose bodies may be larger than `max_body_bytes` (uploads), and their own limit.
    body_limits_by_path: Mapping[str, int] = field(default_factory=dict)
    body_timeouts: BodyTimeouts = BodyTimeouts()
    browser: BrowserRules = field(default_factory=BrowserRules)

    def body_limit(self, path: str) -> int:
        return self.body_limits_by_path.get(path, self.max_body_bytes)


def load_keys(configured: tuple[SecretStr, ...], env_name: str, environ: Mapping[str, str]) -> tuple[bytes, ...]:
    """`configured` keys plus the comma-separated ones of the environment variable `env_name` in `environ`."""
    keys = [key.get_secret_value() for key in configured] + environ.get(env_name, "").split(",")
    return tuple(key.strip().encode() for key in keys if key.strip())


def load_api_keys(security: SecurityArgs, environ: Mapping[str, str] = os.environ) -> tuple[bytes, ...]:
    """The API keys: `security.api_keys` plus those of `API_KEYS_ENV` in this process."""
    return load_keys(security.api_keys, API_KEYS_ENV, environ)


def load_admin_keys(security: SecurityArgs, environ: Mapping[str, str] = os.environ) -> tuple[bytes, ...]:
    """The admin keys: `security.admin_keys` plus those of `ADMIN_KEYS_ENV` in this process."""
    return load_keys(security.admin_keys, ADMIN_KEYS_ENV, environ)


def keys_configured(security: SecurityArgs, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the server has API keys (admin keys count): from `security` and the environment of this process."""
    return bool(load_api_keys(security, environ) + load_admin_keys(security, environ))


def is_open(path: str) -> bool:
    """Whether `path` (the app's own, without the route prefix) is served without an API key."""
    return path in OPEN_PATHS or path == "" or path.startswith(OPEN_PREFIXES)


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key of `Authorization: Bearer <key>`, else of a WebSocket subprotocol that carries one."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return websocket_protocol_key(headers)


def websocket_protocol_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a browser offered as a `Sec-WebSocket-Protocol` entry (`WEBSOCKET_KEY_PROTOCOL_PREFIX`), if any."""
    offered = header(headers, b"sec-websocket-protocol") or ""
    for protocol in offered.split(","):
        encoded = protocol.strip().removeprefix(WEBSOCKET_KEY_PROTOCOL_PREFIX)
        if encoded != protocol.strip():
            try:
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            except ValueError:
                return None
    return None


async def refuse(scope: Scope, receive: Receive, send: Send, status: int, content: bytes, headers: Headers) -> None:
    """Answer an HTTP request, or refuse a WebSocket handshake, with `status` and a JSON body. A server without
    ASGI's WebSocket denial response can only close the handshake, which the client sees as a 403."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()), *headers]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})
        return
    await receive()  # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": content})
    else:
        await send({"type": "websocket.close", "code": 1008})


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
    """421 for an unknown Host and 403 for a cross-origin write (`BrowserRules`), 401 without a valid bearer key
    (when keys are configured; /healthz and the page are open), 413 for a body over the limit, 408 for one that
    does not arrive in time."""

    def __init__(self, app: ASGIApp, error_body: ErrorBody, settings: GuardSettings) -> None:
        self.app = app
        self.error_body = error_body
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings = self.settings
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        # The app's own path: under a Serve route prefix, `path` starts with it (it is also the `root_path`).
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        method = scope.get("method", WEBSOCKET)
        refusal = settings.browser.refusal(method, headers)
        if refusal is not None:
            logger.warning("rejected %s %s: %s", method, scope["path"], refusal[2])
            await self.reply(scope, receive, send, *refusal)
            return
        if settings.api_keys and not is_open(path) and not key_is_valid(bearer_token(headers), settings.api_keys):
            logger.warning("rejected %s %s: missing or invalid API key", method, scope["path"])
            await self.reply(
                scope,
                receive,
                send,
                401,
                "missing or invalid API key (send `Authorization: Bearer <key>`)",
                "invalid_api_key",
            )
            return
        if scope["type"] == "websocket":  # no body: its messages are the route's to read and bound
            await self.app(scope, receive, send)
            return
        limit = settings.body_limit(path)
        try:
            body = await read_body_within(settings.body_timeouts.bound(receive), headers, limit)
        except BodyReadTimeoutError as exc:
            logger.warning("rejected %s %s: the body stalled", method, scope["path"])
            await self.reply(scope, receive, send, 408, str(exc), "body_read_timeout")
            return
        if body is None:
            await self.reply(
                scope, receive, send, 413, f"the request body is larger than {limit} bytes", "body_too_large"
            )
            return
        await self.app(scope, replay_body(body, receive), send)

    async def reply(self, scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str) -> None:
        content = json.dumps(self.error_body(status, message, code)).encode()
        headers = []
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if status == 408:  # the rest of the body may still come: the connection cannot carry another request
            headers.append((b"connection", b"close"))
        await refuse(scope, receive, send, status, content, headers)


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
