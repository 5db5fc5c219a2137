"""The guard's defences against slow clients and browser attacks, on its ASGI app without Ray: the body-read
timeouts (408), unknown Host headers (421, DNS rebinding), cross-origin writes (403, CSRF), the warning about
serving beyond loopback without API keys, and what `cosyvoice-serve run` warns about."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, WebSocket
from starlette.testclient import TestClient, WebSocketDenialResponse

from serve_app.browser_rules import BrowserRules, browser_rules
from serve_app.cli_run import startup_warnings
from serve_app.errors import error_body
from serve_app.guard import (
    WEBSOCKET_KEY_PROTOCOL_PREFIX,
    WEBSOCKET_PROTOCOL,
    BodyTimeouts,
    GuardSettings,
    RequestGuard,
    serving_warnings,
)
from serve_app.request_args import SecurityArgs
from tests.serve.conftest import healthz_routes

KEY = "k-0123456789abcdef"
IDLE_S = 0.3


def _app(settings: GuardSettings) -> FastAPI:
    """An app behind the guard with `settings`."""
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"size": len(await request.body())}

    @app.get("/echo")
    async def read() -> dict[str, str]:
        return {"read": "ok"}

    @app.websocket("/ws")
    async def hello(ws: WebSocket) -> None:
        await ws.accept(subprotocol=WEBSOCKET_PROTOCOL if WEBSOCKET_PROTOCOL in ws.scope["subprotocols"] else None)
        await ws.send_text("hello")
        await ws.close()

    app.add_middleware(RequestGuard, error_body=error_body, settings=settings)
    return app


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def _call(app: FastAPI, receive) -> tuple[list[dict[str, Any]], float]:
    """Messages the app sends for a POST /echo whose body comes from `receive`, and the seconds it took."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/echo",
        "raw_path": b"/echo",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-length", b"1000")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    start = time.monotonic()
    await app(scope, receive, send)
    return sent, time.monotonic() - start


def _status_and_json(sent: list[dict[str, Any]]) -> tuple[int, dict[str, str], dict[str, Any]]:
    start = next(message for message in sent if message["type"] == "http.response.start")
    body = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    headers = {name.decode(): value.decode() for name, value in start["headers"]}
    return start["status"], headers, json.loads(body)


def test_a_body_that_stalls_gets_408_and_closes_the_connection() -> None:
    app = _app(GuardSettings((), 1 << 20, body_timeouts=BodyTimeouts(idle_s=IDLE_S, total_s=60)))
    pieces = [{"type": "http.request", "body": b"x" * 10, "more_body": True}]

    async def stalls() -> dict[str, Any]:
        if pieces:
            return pieces.pop()
        await asyncio.Event().wait()  # the client sends nothing more, and stays connected
        raise AssertionError("unreachable")

    sent, took_s = _run(_call(app, stalls))
    status, headers, body = _status_and_json(sent)
    assert status == 408
    assert headers["connection"] == "close"
    assert body["error"]["code"] == "body_read_timeout" and body["error"]["type"] == "invalid_request_error"
    assert "did not arrive in time" in body["error"]["message"]
    assert took_s >= IDLE_S


def test_a_body_that_trickles_in_gets_408_at_the_total_deadline() -> None:
    total_s = 0.5
    app = _app(GuardSettings((), 1 << 20, body_timeouts=BodyTimeouts(idle_s=10, total_s=total_s)))

    async def trickles() -> dict[str, Any]:
        await asyncio.sleep(0.02)  # never a long pause, never the end
        return {"type": "http.request", "body": b"x", "more_body": True}

    sent, took_s = _run(_call(app, trickles))
    status, _, body = _status_and_json(sent)
    assert status == 408 and body["error"]["code"] == "body_read_timeout"
    assert took_s >= total_s


def test_a_body_that_arrives_in_pieces_within_the_timeouts_passes() -> None:
    app = _app(GuardSettings((), 1 << 20, body_timeouts=BodyTimeouts(idle_s=IDLE_S, total_s=60)))
    pieces = [{"type": "http.request", "body": b"x" * 10, "more_body": index < 4} for index in range(5)]

    async def in_pieces() -> dict[str, Any]:
        await asyncio.sleep(IDLE_S / 3)
        return pieces.pop(0)

    sent, _ = _run(_call(app, in_pieces))
    status, _, body = _status_and_json(sent)
    assert status == 200 and body == {"size": 50}


def _requests(app: FastAPI, requests: list[tuple[str, dict[str, str]]]) -> list[httpx.Response]:
    async def calls() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return [await client.request(method, "/echo", content=b"{}", headers=extra) for method, extra in requests]

    return _run(calls())


def test_without_keys_unknown_hosts_get_421() -> None:
    app = _app(GuardSettings((), 1 << 20, browser=browser_rules(SecurityArgs(), "10.0.0.5", has_keys=False)))
    allowed = ["localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST", "10.0.0.5:8000", "localhost."]
    refused = ["evil.example:8000", "evil.example", "127.0.0.1.evil.example", "10.0.0.6:8000"]
    responses = _requests(app, [("POST", {"host": host}) for host in allowed + refused])
    assert [response.status_code for response in responses] == [200] * len(allowed) + [421] * len(refused)
    error = responses[-1].json()["error"]
    assert error["code"] == "bad_host" and "'10.0.0.6'" in error["message"] and "allowed_hosts" in error["message"]


@pytest.mark.parametrize(
    ("security", "bound", "has_keys", "host", "status"),
    [
        (SecurityArgs(allowed_hosts=("*",)), "127.0.0.1", False, "anything.example", 200),
        (SecurityArgs(allowed_hosts=("TTS.Example.com.", "::1")), None, True, "tts.example.com:443", 200),
        (SecurityArgs(allowed_hosts=("tts.example.com", "::1")), None, True, "[::1]:8000", 200),
        (SecurityArgs(allowed_hosts=("tts.example.com",)), None, True, "localhost:8000", 421),  # listed: enforced
        (SecurityArgs(), "0.0.0.0", True, "anything.example", 200),  # keys: the key is the defence
        (SecurityArgs(), "0.0.0.0", False, "192.168.1.7:8000", 421),  # a wildcard bind names no host
        (SecurityArgs(), None, False, "127.0.0.1:8000", 200),  # bound host unknown: loopback names
    ],
)
def test_allowed_hosts_setting(
    security: SecurityArgs, bound: str | None, has_keys: bool, host: str, status: int
) -> None:
    app = _app(GuardSettings((), 1 << 20, browser=browser_rules(security, bound, has_keys)))
    assert _requests(app, [("POST", {"host": host})])[0].status_code == status


def test_without_keys_cross_origin_writes_get_403_and_same_origin_pages_pass() -> None:
    app = _app(GuardSettings((), 1 << 20, browser=browser_rules(SecurityArgs(), "127.0.0.1", has_keys=False)))
    own = {"host": "127.0.0.1:8000"}
    passing = [
        ("POST", own),  # curl, the openai SDKs: no Origin
        ("POST", own | {"origin": "http://127.0.0.1:8000"}),  # the page served at /
        ("POST", {"host": "localhost", "origin": "http://localhost:80"}),  # default port spelled out
        ("GET", own | {"origin": "https://evil.example"}),  # reads are not writes
    ]
    refused = [
        ("POST", own | {"origin": "https://evil.example"}),
        ("DELETE", own | {"origin": "https://evil.example"}),
        ("POST", own | {"origin": "http://127.0.0.1:9999"}),  # another port is another origin
        ("POST", own | {"origin": "null"}),  # a sandboxed frame or a file:// page
    ]
    responses = _requests(app, passing + refused)
    assert [response.status_code for response in responses] == [200] * len(passing) + [403] * len(refused)
    error = responses[len(passing)].json()["error"]
    assert error["code"] == "cross_origin_refused" and "https://evil.example" in error["message"]
    assert "security.api_keys" in error["message"]


def test_listed_origins_and_servers_with_keys_take_cross_origin_writes() -> None:
    listed = SecurityArgs(allowed_origins=("http://localhost:3000/",))
    app = _app(GuardSettings((), 1 << 20, browser=browser_rules(listed, "127.0.0.1", has_keys=False)))
    own = {"host": "127.0.0.1:8000"}
    dev, other = (own | {"origin": origin} for origin in ("http://LOCALHOST:3000", "http://localhost:3001"))
    assert [response.status_code for response in _requests(app, [("POST", dev), ("POST", other)])] == [200, 403]
    app = _app(GuardSettings((KEY.encode(),), 1 << 20, browser=browser_rules(SecurityArgs(), "0.0.0.0", has_keys=True)))
    keyed = own | {"origin": "https://evil.example", "authorization": f"Bearer {KEY}"}
    assert _requests(app, [("POST", keyed)])[0].status_code == 200


def _websocket(app: FastAPI, headers: dict[str, str], subprotocols: list[str] | None = None) -> tuple[str, str | None]:
    """The greeting of the app's WebSocket and the subprotocol it accepted; WebSocketDenialResponse if refused."""
    with TestClient(app).websocket_connect(
        "/ws", headers={"host": "127.0.0.1:8000"} | headers, subprotocols=subprotocols
    ) as ws:
        return ws.receive_text(), ws.accepted_subprotocol


def _denial(app: FastAPI, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    with pytest.raises(WebSocketDenialResponse) as denied:
        _websocket(app, headers)
    return denied.value.status_code, denied.value.json()["error"]


def test_a_websocket_handshake_is_checked_as_a_write_and_may_carry_the_key_as_a_subprotocol() -> None:
    # Any page may open a WebSocket to any host (CORS does not cover it): without keys, only the server's own page.
    app = _app(GuardSettings((), 1 << 20, browser=browser_rules(SecurityArgs(), "127.0.0.1", has_keys=False)))
    assert _websocket(app, {"origin": "http://127.0.0.1:8000"}) == ("hello", None)
    assert _websocket(app, {})[0] == "hello"  # a program: no Origin
    status, error = _denial(app, {"origin": "https://evil.example"})
    assert status == 403 and error["code"] == "cross_origin_refused"

    app = _app(
        GuardSettings((KEY.encode(),), 1 << 20, browser=browser_rules(SecurityArgs(), "127.0.0.1", has_keys=True))
    )
    status, error = _denial(app, {})
    assert status == 401 and error["code"] == "invalid_api_key"
    assert _websocket(app, {"authorization": f"Bearer {KEY}"})[0] == "hello"
    # A browser cannot set headers on a WebSocket: it offers the key, base64url, as a subprotocol.
    encoded = base64.urlsafe_b64encode(KEY.encode()).decode().rstrip("=")
    offered = [WEBSOCKET_PROTOCOL, WEBSOCKET_KEY_PROTOCOL_PREFIX + encoded]
    assert _websocket(app, {}, offered) == ("hello", WEBSOCKET_PROTOCOL)
    wrong = base64.urlsafe_b64encode(b"not-the-key").decode()
    with pytest.raises(WebSocketDenialResponse):
        _websocket(app, {}, [WEBSOCKET_PROTOCOL, WEBSOCKET_KEY_PROTOCOL_PREFIX + wrong])


def test_the_default_guard_checks_no_host_or_origin() -> None:
    assert BrowserRules().refusal("POST", [(b"host", b"evil.example"), (b"origin", b"https://evil.example")]) is None


def test_serving_beyond_loopback_without_keys_is_a_warning() -> None:
    security = SecurityArgs()
    (warning,) = serving_warnings(security, "0.0.0.0", has_keys=False)
    assert "0.0.0.0" in warning and "without API keys" in warning and "COSYVOICE_API_KEYS" in warning
    for bound in ("127.0.0.1", "localhost", "::1", "127.0.0.2", None):
        assert serving_warnings(security, bound, has_keys=False) == ()
    assert serving_warnings(security, "0.0.0.0", has_keys=True) == ()


def test_healthz_carries_the_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.serve

    from serve_app import routing
    from serve_app.routing import ENCODER, GPU_DECODER, DecoderRouter

    async def running(app_name: str, names) -> dict[str, int]:
        return {ENCODER: 1, GPU_DECODER: 1}

    monkeypatch.setattr(routing, "running_replicas", running)
    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(app_name="app"))

    async def probe(warnings: tuple[str, ...]) -> dict[str, Any]:
        router = DecoderRouter({GPU_DECODER: "gpu"}, poll_interval_s=3600)
        await router.refresh("app")
        response = await healthz_routes(router, warnings).healthz()
        assert response.status_code == 200
        return json.loads(response.body)

    assert _run(probe(("serving beyond loopback",)))["warnings"] == ["serving beyond loopback"]
    assert _run(probe(()))["warnings"] == []


def test_run_warns_about_ray_auth_off_and_serving_beyond_loopback_without_keys() -> None:
    assert startup_warnings({}, "127.0.0.1", environ={}) == []
    (auth_off,) = startup_warnings({}, "127.0.0.1", environ={"RAY_AUTH_MODE": "disabled"})
    assert "RAY_AUTH_MODE=disabled" in auth_off
    (keyless,) = startup_warnings({}, "0.0.0.0", environ={})
    assert "without API keys" in keyless
    assert startup_warnings({}, "0.0.0.0", environ={"COSYVOICE_API_KEYS": "k1"}) == []
    assert startup_warnings({"security": {"api_keys": ["k2"]}}, "0.0.0.0", environ={}) == []
