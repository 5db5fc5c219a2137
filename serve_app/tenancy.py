"""Tenants, when API keys are on: who each request's key is, for the registered voices, and how many requests one
key may have in flight.

`KeyTenancy` is a plain ASGI middleware inside `RequestGuard`, so with keys on only requests with a valid key
(or to an open path, without one) reach it. It puts the caller (`voice_registry.Caller`: the key's owner id and
whether it is an admin key) on the request scope, where the endpoints read it with `caller_of`. Like the guard,
each ingress replica gives it its settings (`serve_app.api.build_api`), and its counts are per replica.

A key is never stored: the voices it registers hold its owner id, a one-way HMAC-SHA256 of the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import threading
from dataclasses import dataclass

from engine.voices.registry import EVERYONE, Caller
from serve_app.browser_rules import WEBSOCKET
from serve_app.errors import RETRY_AFTER_S
from serve_app.guard import (
    ASGIApp,
    ErrorBody,
    Receive,
    Scope,
    Send,
    bearer_token,
    key_is_valid,
    refuse,
)

logger = logging.getLogger("ray.serve")

# The HMAC key of owner ids: ties them to this use, so a table of hashes made for anything else does not match.
OWNER_ID_CONTEXT = b"cosyvoice-serve voice owner v1"
OWNER_ID_HEX_CHARS = 32  # 128 bits


def owner_id(key: bytes) -> str:
    """The id stored with the voices an API key registers, instead of the key (not reversible for a random key)."""
    return hmac.new(OWNER_ID_CONTEXT, key, hashlib.sha256).hexdigest()[:OWNER_ID_HEX_CHARS]


@dataclass(frozen=True)
class TenancySettings:
    keys_on: bool  # False: every caller is `EVERYONE` and nothing is limited per key
    admin_keys: tuple[bytes, ...]  # keys that see, use and delete every registered voice
    max_concurrent_requests_per_key: int | None  # None: no limit
    retry_after_s: float = RETRY_AFTER_S  # the Retry-After of the 429


def caller_of(scope: Scope) -> Caller:
    """The request's caller, as `KeyTenancy` put it on the scope (a KeyError where it did not: never a default
    that could see every voice)."""
    return scope["state"]["caller"]


class KeySlots:
    """Requests in flight per owner id, each at most a limit."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, owner: str, limit: int) -> bool:
        with self._lock:
            held = self._held.get(owner, 0)
            if held >= limit:
                return False
            self._held[owner] = held + 1
            return True

    def release(self, owner: str) -> None:
        with self._lock:
            held = self._held.pop(owner) - 1
            if held:
                self._held[owner] = held

    def held(self, owner: str) -> int:
        return self._held.get(owner, 0)


class KeyTenancy:
    """Puts the caller on the scope; with keys on and a limit, answers 429 (with Retry-After) to a key that already
    has `max_concurrent_requests_per_key` requests in flight. A request holds its slot until the app returns: after
    the whole response (a stream's last chunk), an error, or a cancel (the client left)."""

    def __init__(self, app: ASGIApp, error_body: ErrorBody, settings: TenancySettings) -> None:
        self.app = app
        self.error_body = error_body
        self.settings = settings
        self.slots = KeySlots()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings = self.settings
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if not settings.keys_on:
            scope.setdefault("state", {})["caller"] = EVERYONE
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope.get("headers", []))
        if token is None:  # an open path (the guard refused the others): no caller, no voices
            await self.app(scope, receive, send)
            return
        owner = owner_id(token)
        scope.setdefault("state", {})["caller"] = Caller(owner=owner, admin=key_is_valid(token, settings.admin_keys))
        limit = settings.max_concurrent_requests_per_key
        if limit is None:
            await self.app(scope, receive, send)
            return
        if not self.slots.acquire(owner, limit):
            method = scope.get("method", WEBSOCKET)
            logger.warning(
                "rejected %s %s: key %s... has %d requests in flight", method, scope["path"], owner[:8], limit
            )
            message = f"this API key already has {limit} requests in flight (the limit); retry when one has ended"
            await self.reply_429(scope, receive, send, message, settings.retry_after_s)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.slots.release(owner)

    async def reply_429(self, scope: Scope, receive: Receive, send: Send, message: str, retry_after_s: float) -> None:
        content = json.dumps(self.error_body(429, message, "rate_limit_exceeded")).encode()
        await refuse(
            scope, receive, send, 429, content, [(b"retry-after", str(max(0, math.ceil(retry_after_s))).encode())]
        )
