"""`TextRelay`: the text of a bi-streamed WebSocket session, from the ingress replica that holds the connection to the
decoder replica that speaks it.

Serve routes every call anew, so text that arrives after the decoder's streaming call began cannot be sent to that
replica by another call: the ingress puts each piece's ids here (one relay actor per ingress replica, made on its
first session) and the decoder's `bistream` call takes them out, in order, until the end (None).
"""

from __future__ import annotations

import asyncio

import ray


@ray.remote(num_cpus=0)
class TextRelay:
    def __init__(self) -> None:
        self._sessions: dict[str, asyncio.Queue[list[int] | None]] = {}

    def _queue(self, session: str) -> asyncio.Queue[list[int] | None]:
        return self._sessions.setdefault(session, asyncio.Queue())

    async def put(self, session: str, tokens: list[int] | None) -> None:
        """The next piece's text ids; None: the text has ended."""
        self._queue(session).put_nowait(tokens)

    async def get(self, session: str) -> list[int] | None:
        """The next piece's text ids, once they come; None at the end of the text or once the session is closed."""
        return await self._queue(session).get()

    async def close(self, session: str) -> None:
        """Forget the session; a `get` waiting on it returns None."""
        queue = self._sessions.pop(session, None)
        if queue is not None:
            queue.put_nowait(None)
