"""Slow clients and browser requests against a real local Ray Serve (tiny model, CPU): uploads that stall
mid-body get 408 after `serve_app.guard.BODY_READ_IDLE_S` and free their ingress slot, so /healthz and normal requests
still answer while more stalled clients are connected than the ingress takes at once; clients that stall inside
their headers never reach the ingress at all; unknown Host headers and cross-origin writes are refused.

Serve's HTTP proxy (uvicorn 0.55) has no header-read timeout: its keep-alive timer starts only after a response,
so a header-only stall holds a proxy socket (not an ingress slot) until the client goes; a load balancer or
reverse proxy in front bounds that (docs/reliability.md).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from serve_app.guard import BODY_READ_IDLE_S
from tests.serve.conftest import running_app

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

APP = "slow_clients"
INGRESS_ONGOING = 8
STALLED = 12  # more than the ingress takes at once: without the timeout, they would hold every slot for good
HEADER_ONLY = 20
DECLARED_BYTES = 1000
# A loopback address that is not a default allowed host: the ingress must learn it from Serve's http_options.
HOST = "127.0.0.2"
ARGS = {
    "model": "tiny",
    "decoder": {"num_cpus": 0.4},
    "limits": {"max_text_streams": INGRESS_ONGOING // 2},
}
DEPLOYMENTS = [
    {"name": "TTSIngress", "max_ongoing_requests": INGRESS_ONGOING, "ray_actor_options": {"num_cpus": 0.1}},
    {"name": "Encoder", "ray_actor_options": {"num_cpus": 0.2}},
]
SHORT = {"text": "Hello there.", "sampling": {"max_token_text_ratio": 3.0}}  # tiny weights: keep decodes short


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running_app(ARGS, APP, host=HOST, deployments=DEPLOYMENTS) as url:
        yield url


def _port(base_url: str) -> int:
    return int(base_url.rsplit(":", 1)[1])


def _connect(base_url: str, request_head: str, body: bytes = b"") -> socket.socket:
    sock = socket.create_connection((HOST, _port(base_url)), timeout=60)
    sock.sendall(request_head.encode() + body)
    return sock


def _stalled_upload(base_url: str) -> socket.socket:
    """Headers and 10 bytes of a declared 1000-byte body, then nothing."""
    head = (
        f"POST /v1/tts HTTP/1.1\r\nHost: {HOST}:{_port(base_url)}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {DECLARED_BYTES}\r\n\r\n"
    )
    return _connect(base_url, head, b'{"text": "')


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket.timeout fails the test)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _serves_normally(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        assert client.get("/healthz").status_code == 200
        response = client.post("/v1/tts", json=SHORT)
        assert response.status_code == 200 and response.content[:4] == b"RIFF"


def test_header_only_stalls_never_reach_the_ingress(base_url: str) -> None:
    head = f"POST /v1/tts HTTP/1.1\r\nHost: {HOST}:{_port(base_url)}\r\nContent-Length: {DECLARED_BYTES}\r\n"
    stalled = [_connect(base_url, head) for _ in range(HEADER_ONLY)]  # no blank line: the headers never end
    try:
        _serves_normally(base_url)
    finally:
        for sock in stalled:
            sock.close()


def test_stalled_uploads_get_408_and_free_their_ingress_slots(base_url: str) -> None:
    started = time.monotonic()
    stalled = [_stalled_upload(base_url) for _ in range(STALLED)]
    try:
        _serves_normally(base_url)
        answers = [_read_until_closed(sock) for sock in stalled]
    finally:
        for sock in stalled:
            sock.close()
    assert time.monotonic() - started >= BODY_READ_IDLE_S
    for answer in answers:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "body_read_timeout" and error["type"] == "invalid_request_error"


def test_unknown_hosts_and_cross_origin_writes_are_refused(base_url: str) -> None:
    own_origin = f"http://{HOST}:{_port(base_url)}"
    with httpx.Client(base_url=base_url, timeout=60) as client:
        health = client.get("/healthz")
        # HTTP on loopback: no API keys needed (the test's own Ray, unlike `run`'s, has its ports on every interface)
        assert health.status_code == 200 and not [w for w in health.json()["warnings"] if "without API keys" in w]
        rebound = client.get("/v1/voices", headers={"Host": f"evil.example:{_port(base_url)}"})
        assert rebound.status_code == 421 and rebound.json()["error"]["code"] == "bad_host"
        files = {"file": ("v.wav", b"RIFF", "audio/wav")}
        forged = client.post("/v1/voices", files=files, data={"transcript": "hi"}, headers={"Origin": "https://x.test"})
        assert forged.status_code == 403 and forged.json()["error"]["code"] == "cross_origin_refused"
        page = client.post("/v1/tts", json=SHORT, headers={"Origin": own_origin})  # the page served at /
        assert page.status_code == 200
