"""Request ids and per-request metrics for the FastAPI ingress.

Serve's proxy already takes the client's `X-Request-ID` (or makes one), uses it as the request id of
its own logs and of every handle call downstream, and returns it in the `X-Request-ID` response
header of every response. `RequestObservability` adds what the proxy does not: it rejects ids that
are too long or carry unsafe characters, hands the id to the route handlers (`request_id_of`) and
counts every request by endpoint and status code.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from observability.metrics import IngressMetrics

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
UNMATCHED_ENDPOINT = "unmatched"  # one label for every unknown path, so scanners cannot grow the series


@functools.cache
def ingress_metrics() -> IngressMetrics:
    """The ingress replica's metrics, built on first use inside the replica (where Serve adds its tags)."""
    return IngressMetrics()


def is_valid_request_id(value: str) -> bool:
    return REQUEST_ID_PATTERN.fullmatch(value) is not None


def request_id_of(scope: Scope) -> str:
    return scope["state"]["request_id"]


def endpoint_of(scope: Scope) -> str:
    """The matched route's path template (after routing), else `UNMATCHED_ENDPOINT`."""
    route = scope.get("route")
    return getattr(route, "path", None) or UNMATCHED_ENDPOINT


COMPLETE, ABORTED = "complete", "aborted"  # a request's outcome: its whole response sent, or cut after its status


class RequestObservability:
    """Pure ASGI middleware (it must not buffer streaming bodies); `reject(message)` answers a bad id."""

    def __init__(self, app: ASGIApp, reject: Callable[[str], Response]) -> None:
        self.app = app
        self.reject = reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        # Serve's proxy always sets the header; a bare ASGI server (tests, other hosts) may not.
        request_id = Headers(scope=scope).get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        if scope["type"] == "websocket":  # the route reports its errors in the stream, not by status
            scope.setdefault("state", {})["request_id"] = (
                request_id if is_valid_request_id(request_id) else uuid.uuid4().hex
            )
            await self.app(scope, receive, send)
            return
        status = 500  # stays 500 when the app raises before it starts a response
        started = ended = False
        if is_valid_request_id(request_id):
            scope.setdefault("state", {})["request_id"] = request_id

            async def send_and_note_status(message: Message) -> None:
                nonlocal status, started, ended
                if message["type"] == "http.response.start":
                    status, started = message["status"], True
                elif message["type"] == "http.response.body" and not message.get("more_body", False):
                    ended = True
                await send(message)

            try:
                await self.app(scope, receive, send_and_note_status)
            finally:
                # A body cut after its status line (a stream that failed, or whose client left) is not what its
                # status says: counted apart, as aborted.
                self._count(scope, status, ABORTED if started and not ended else COMPLETE)
            return
        await self.reject(
            f"invalid X-Request-ID: use 1-128 characters among letters, digits and . _ : -, got {len(request_id)}"
        )(scope, receive, send)
        self._count(scope, 400, COMPLETE)

    @staticmethod
    def _count(scope: Scope, status: int, outcome: str) -> None:
        # No access log line here: Serve's replica already writes one per request, with its request_id.
        tags = {"endpoint": endpoint_of(scope), "status_code": str(status), "outcome": outcome}
        ingress_metrics().requests.inc(tags=tags)


@dataclass
class SynthesisTimer:
    """Times one synthesis from its start: first audio, last audio, audio length; recorded on `done()`."""

    endpoint: str
    mode: str
    sample_rate: int
    started: float = field(default_factory=time.perf_counter)
    first_chunk_s: float | None = None
    samples: int = 0

    def audio(self, chunk: np.ndarray) -> None:
        if self.first_chunk_s is None:
            self.first_chunk_s = time.perf_counter() - self.started
        self.samples += len(chunk)

    def done(self) -> None:
        latency_s = time.perf_counter() - self.started
        first_chunk_s = latency_s if self.first_chunk_s is None else self.first_chunk_s
        ingress_metrics().record_synthesis(
            self.endpoint, self.mode, first_chunk_s, latency_s, self.samples / self.sample_rate
        )

    async def measure(self, chunks: AsyncIterator[np.ndarray]) -> AsyncIterator[np.ndarray]:
        """Pass `chunks` through, timing them; recorded only when the stream ends (not when the client left)."""
        async for chunk in chunks:
            self.audio(chunk)
            yield chunk
        self.done()
