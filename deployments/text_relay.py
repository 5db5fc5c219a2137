"""`TextRelay`: the text of a bi-streamed WebSocket session, from the ingress replica that holds the connection to the
decoder replica that speaks it.

Serve routes every call anew, so text that arrives after the decoder's streaming call began cannot be sent to that
replica by another call: the ingress puts each piece's ids here (one relay actor per ingress replica, made on its
first session) and the decoder's `bistream` call reads them, piece by piece in order, until the end (None). The
pieces stay until the session closes, so a call sent again to another replica (its replica was lost before the first
audio) reads them again from the first. A session the ingress closed (its client left, or it failed) stays closed: a
`get` for it, waiting or later (a decoder call that started after the close), raises `TextSessionClosedError`, so no
decoder waits for text that will never come. `TextRelays` is the ingress replica's hold on its relay.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import ray
from ray.exceptions import RayActorError

# How long a closed session is remembered: longer than any decoder call that might still start for it waits in a
# queue (limits.max_stream_s bounds a call's time in the decoder, queued or decoding).
CLOSED_SESSION_MEMORY_S = 900.0
RELAY_NAME_PREFIX = "text-relay-"  # named, so that an operator (or a test) finds the ingress replicas' relays


class TextSessionClosedError(Exception):
    """The ingress closed the session (its client left, or it failed): its decoder call ends, as nobody listens."""

    def __init__(self, message: str = "the text stream's session was closed") -> None:  # one argument: Ray re-raises it
        super().__init__(message)


class _SessionText:
    """One session's pieces so far (None last once the text has ended), and the condition a `get` waits on."""

    def __init__(self) -> None:
        self.pieces: list[list[int] | None] = []
        self.closed = False
        self.changed = asyncio.Condition()


class SessionTexts:
    """What a `TextRelay` holds and answers: every session's pieces (the actor is this class, for Ray)."""

    def __init__(self) -> None:
        self._sessions: dict[str, _SessionText] = {}
        self._closed: dict[str, float] = {}  # session -> when it was closed

    def _text(self, session: str) -> _SessionText:
        if session in self._closed:
            raise TextSessionClosedError()
        return self._sessions.setdefault(session, _SessionText())

    async def put(self, session: str, tokens: list[int] | None) -> None:
        """The next piece's text ids; None: the text has ended."""
        text = self._text(session)
        async with text.changed:
            text.pieces.append(tokens)
            text.changed.notify_all()

    async def get(self, session: str, index: int) -> list[int] | None:
        """The text ids of piece `index` (0: the first), once it comes; None at the end of the text;
        TextSessionClosedError once the session is closed."""
        text = self._text(session)
        async with text.changed:
            await text.changed.wait_for(lambda: text.closed or index < len(text.pieces))
        if text.closed:
            raise TextSessionClosedError()
        return text.pieces[index]

    async def close(self, session: str) -> None:
        """Forget the session; a `get` waiting on it, or asking for it later, raises TextSessionClosedError."""
        now = time.monotonic()
        self._closed = {closed: at for closed, at in self._closed.items() if now - at < CLOSED_SESSION_MEMORY_S}
        self._closed[session] = now
        text = self._sessions.pop(session, None)
        if text is not None:
            async with text.changed:
                text.closed = True
                text.changed.notify_all()

    def ping(self) -> bool:
        return True


TextRelay = ray.remote(num_cpus=0)(SessionTexts)


class TextRelays:
    """An ingress replica's `TextRelay` (one for all its bi-streamed sessions), made when first needed. One found lost
    (a call to it failed with its actor gone: `lost`) fails its own sessions alone: the next session, or /healthz's
    probe, makes another, and /healthz reports the replica degraded until that one answers (`problem`)."""

    def __init__(self) -> None:
        self._relay: ray.actor.ActorHandle | None = None
        self._lost = False  # a relay was lost and no successor has answered yet

    def relay(self) -> ray.actor.ActorHandle:
        if self._relay is None:
            self._relay = TextRelay.options(name=RELAY_NAME_PREFIX + uuid.uuid4().hex[:12]).remote()
        return self._relay

    def lost(self, relay: ray.actor.ActorHandle) -> None:
        if self._relay is relay:
            self._relay, self._lost = None, True

    async def problem(self, timeout_s: float) -> str | None:
        """None while the relay answers (or none is needed yet), else what is wrong with it."""
        if self._relay is None and not self._lost:
            return None
        relay = self.relay()
        try:
            await asyncio.wait_for(relay.ping.remote(), timeout_s)
        except RayActorError:
            self.lost(relay)
            return "the text relay of this ingress replica was lost: its text streams failed (1013); the next makes one"
        except asyncio.TimeoutError:  # on Python 3.10 not the built-in TimeoutError
            return f"the text relay of this ingress replica did not answer within {timeout_s:g} s"
        self._lost = False
        return None
