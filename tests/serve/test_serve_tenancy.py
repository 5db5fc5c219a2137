"""Tenancy with API keys on: owner ids, the per-key limit on requests in flight (`serve_app.tenancy`, as plain ASGI,
no Ray), then on a real Serve app (tiny model, voice cloning, two keys and an admin key): each key sees, uses and
deletes only its own voices and the shared ones, and a key over its limit gets 429 without starving the others
or leaking a slot. The same app serves Wyoming to clients without a key (`wyoming.allow_keyless`), driven by the
`wyoming` client library as Home Assistant drives it: they see and use the shared voices only, get their audio chunk
by chunk (a text stream's first sentence before its text ends), and errors as `error` events; one that leaves
mid-stream has its decode cancelled while others are served."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray import serve
from wyoming.audio import AudioChunk, AudioStart
from wyoming.client import AsyncTcpClient
from wyoming.event import Event, async_read_event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice
from zeroconf import DNSAddress, DNSIncoming, DNSOutgoing, DNSQuestion, DNSService
from zeroconf.const import _CLASS_IN, _FLAGS_QR_QUERY, _TYPE_SRV

from engine.voices.registry import EVERYONE, Caller
from serve_app.bench.http_load import free_port
from serve_app.cli import main as cli_main
from serve_app.cli_client import API_KEY_ENV
from serve_app.errors import RETRY_AFTER_S as SERVED_RETRY_AFTER_S
from serve_app.errors import error_body
from serve_app.guard import load_admin_keys
from serve_app.request_args import LimitsArgs, SecurityArgs
from serve_app.tenancy import (
    KeyTenancy,
    TenancySettings,
    caller_of,
    owner_id,
)
from serve_app.wyoming_listener import WyomingListener
from serve_app.wyoming_zeroconf import MDNS_GROUP, service_name
from tests.serve.conftest import on_cpus, running_app, wait_until
from tests.serve.test_voice_registry import wav_bytes

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

ALICE = "alice-key-5c1f0e27b9d34a68"
BOB = "bob-key-9e3d41a7c2b85f06"
ADMIN = "admin-key-1b7e93c05f2d48a6"
LIMIT = 2
VOICES_PER_KEY = 2
RETRY_AFTER_S = 3  # the middleware's own tests pass theirs; the served app answers SERVED_RETRY_AFTER_S
IDLE_S = 2.0


def test_owner_ids_are_stable_distinct_and_hide_the_key() -> None:
    alice = owner_id(ALICE.encode())
    assert alice == owner_id(ALICE.encode()) and alice != owner_id(BOB.encode())
    assert len(alice) == 32 and int(alice, 16) >= 0
    assert ALICE not in alice and ALICE.encode().hex() not in alice


def test_admin_keys_from_config_and_environment() -> None:
    security = SecurityArgs(admin_keys=("from-config",))
    assert load_admin_keys(security, {"COSYVOICE_ADMIN_KEYS": " env-1, ,env-2 ", "COSYVOICE_API_KEYS": "api"}) == (
        b"from-config",
        b"env-1",
        b"env-2",
    )
    assert "from-config" not in repr(security)


# --- the middleware, as plain ASGI ------------------------------------------------------------------------


class App:
    """An ASGI app that records each request's caller and, per request, answers, streams until released, or fails."""

    def __init__(self) -> None:
        self.callers: list[Caller | None] = []
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.callers.append(scope.get("state", {}).get("caller"))
        behaviour = scope["path"]
        if behaviour == "/fail":
            raise RuntimeError("the endpoint failed")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if behaviour == "/stream":  # the first chunk, then the rest once released
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            self.started.set()
            await self.release.wait()
        await send({"type": "http.response.body", "body": b"done"})


def scope_for(path: str, key: str | None) -> dict[str, Any]:
    headers = [] if key is None else [(b"authorization", f"Bearer {key}".encode())]
    return {"type": "http", "method": "POST", "path": path, "headers": headers}


async def call(middleware: KeyTenancy, path: str, key: str | None) -> list[dict[str, Any]]:
    """The messages `middleware` sends for one request."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await middleware(scope_for(path, key), receive, send)
    return sent


@pytest.fixture
def tenancy() -> Iterator[tuple[KeyTenancy, App]]:
    app = App()
    yield KeyTenancy(app, error_body, TenancySettings(True, (ADMIN.encode(),), LIMIT, RETRY_AFTER_S)), app


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_the_caller_is_on_the_scope() -> None:
    app = App()
    keys_on = KeyTenancy(app, error_body, TenancySettings(True, (ADMIN.encode(),), LIMIT, RETRY_AFTER_S))
    keys_off = KeyTenancy(app, error_body, TenancySettings(False, (), LIMIT, RETRY_AFTER_S))

    async def requests() -> None:
        for key in (ALICE, ADMIN, None):  # None: an open path (the guard lets only those through without a key)
            await call(keys_on, "/ok", key)
        await call(keys_off, "/ok", None)

    _run(requests())
    assert app.callers == [
        Caller(owner_id(ALICE.encode()), admin=False),
        Caller(owner_id(ADMIN.encode()), admin=True),
        None,
        EVERYONE,
    ]
    with pytest.raises(KeyError):  # no caller: the endpoints fail rather than see every voice
        caller_of({"state": {}})


def test_a_key_over_its_limit_gets_429_others_do_not(tenancy: tuple[KeyTenancy, App]) -> None:
    middleware, app = tenancy
    alice = owner_id(ALICE.encode())

    async def scenario() -> tuple[list[Any], ...]:
        streams = [asyncio.create_task(call(middleware, "/stream", ALICE)) for _ in range(LIMIT)]
        while middleware.slots.held(alice) < LIMIT:
            await asyncio.sleep(0.01)
        over = await call(middleware, "/ok", ALICE)
        other = await call(middleware, "/ok", BOB)
        held_while_streaming = middleware.slots.held(alice)
        app.release.set()
        done = await asyncio.gather(*streams)
        return over, other, [held_while_streaming], done

    over, other, [held_while_streaming], done = _run(scenario())
    start, body = over
    assert start["status"] == 429
    assert dict(start["headers"])[b"retry-after"] == str(RETRY_AFTER_S).encode()
    error = json.loads(body["body"])["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["code"] == "rate_limit_exceeded"
    assert f"{LIMIT} requests in flight" in error["message"]
    assert other[0]["status"] == 200
    assert held_while_streaming == LIMIT, "a stream holds its slot until its last chunk"
    assert all(messages[-1]["body"] == b"done" for messages in done)
    assert middleware.slots.held(alice) == 0


def test_failed_and_cancelled_requests_free_their_slots(tenancy: tuple[KeyTenancy, App]) -> None:
    middleware, app = tenancy
    alice = owner_id(ALICE.encode())

    async def scenario() -> list[int]:
        for _ in range(LIMIT + 1):
            with pytest.raises(RuntimeError, match="the endpoint failed"):
                await call(middleware, "/fail", ALICE)
        after_failures = middleware.slots.held(alice)
        stream = asyncio.create_task(call(middleware, "/stream", ALICE))
        await app.started.wait()
        during_stream = middleware.slots.held(alice)
        stream.cancel()  # what Serve does when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await stream
        return [after_failures, during_stream, middleware.slots.held(alice)]

    assert _run(scenario()) == [0, 1, 0]
    assert _run(call(middleware, "/ok", ALICE))[0]["status"] == 200


def test_a_websocket_holds_its_keys_slot_and_one_over_the_limit_is_refused_at_the_handshake(
    tenancy: tuple[KeyTenancy, App],
) -> None:
    middleware, app = tenancy
    alice = owner_id(ALICE.encode())

    async def connect(extensions: dict[str, Any], path: str = "/ok") -> list[dict[str, Any]]:
        scope = scope_for(path, ALICE) | {"type": "websocket", "extensions": extensions}
        del scope["method"]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "websocket.connect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await middleware(scope, receive, send)
        return sent

    async def scenario() -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        await connect({})  # under the limit: it reaches the app, with its caller
        assert app.callers == [Caller(alice, admin=False)] and middleware.slots.held(alice) == 0
        streams = [asyncio.create_task(connect({}, "/stream")) for _ in range(LIMIT)]
        while middleware.slots.held(alice) < LIMIT:
            await asyncio.sleep(0.01)
        with_denial = await connect({"websocket.http.response": {}})
        without = await connect({})
        app.release.set()
        await asyncio.gather(*streams)
        return with_denial, without, middleware.slots.held(alice)

    with_denial, without, held_after = _run(scenario())
    start, body = with_denial
    assert start["type"] == "websocket.http.response.start" and start["status"] == 429
    assert json.loads(body["body"])["error"]["code"] == "rate_limit_exceeded"
    assert without == [{"type": "websocket.close", "code": 1008}]  # a server without denial responses: a 403
    assert held_after == 0


def test_no_limit_when_none_or_keys_off() -> None:
    async def many(settings: TenancySettings, key: str | None) -> list[int]:
        app = App()
        middleware = KeyTenancy(app, error_body, settings)
        streams = [asyncio.create_task(call(middleware, "/stream", key)) for _ in range(LIMIT + 2)]
        while len(app.callers) < len(streams):
            await asyncio.sleep(0.01)
        app.release.set()
        return [messages[0]["status"] for messages in await asyncio.gather(*streams)]

    assert _run(many(TenancySettings(True, (), None, RETRY_AFTER_S), ALICE)) == [200] * (LIMIT + 2)
    assert _run(many(TenancySettings(False, (), LIMIT, RETRY_AFTER_S), None)) == [200] * (LIMIT + 2)


# --- on a real Serve app ----------------------------------------------------------------------------------

SHORT = {"sampling": {"max_token_text_ratio": 3.0}}  # dummy weights rarely stop by themselves
# One sentence forced to ~58 s of speech: a stream that lasts far longer than the test holds it.
LONG_TEXT = (
    "One long sentence keeps the decoder busy, and it goes on and on with many more words in it so that it "
    "lasts a long while."
)
FORCED_LENGTH = {"min_token_text_ratio": 100.0, "max_token_text_ratio": 100.0}
LONG_STREAM = {"format": "pcm", "stream": True, "sampling": FORCED_LENGTH}
UNKNOWN_VOICE = "voice_0123456789ab"


@pytest.fixture(scope="module")
def wyoming_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, wyoming_port: int) -> Iterator[tuple[str, Path]]:
    voices_dir = tmp_path_factory.mktemp("tenancy") / "voices"
    args = {
        "model": "tiny",
        "decoder": {"num_cpus": 0.3},
        "voices_dir": str(voices_dir),  # the cloning models: those the tiny preset ships
        "limits": {
            "max_concurrent_requests_per_key": LIMIT,
            "max_voices_per_key": VOICES_PER_KEY,
        },
        "security": {"api_keys": [ALICE, BOB], "admin_keys": [ADMIN]},
        "wyoming": {"port": wyoming_port, "allow_keyless": True},
    }
    with running_app(args, "tenancy", deployments=on_cpus(TTSIngress=0.1, Encoder=0.1)) as url:
        yield url, voices_dir


@pytest.fixture(scope="module")
def clients(served: tuple[str, Path]) -> Iterator[dict[str, httpx.Client]]:
    base_url, _ = served
    with ExitStack() as stack:
        yield {
            name: stack.enter_context(
                httpx.Client(base_url=base_url, timeout=120, headers={"Authorization": f"Bearer {key}"})
            )
            for name, key in (("alice", ALICE), ("bob", BOB), ("admin", ADMIN))
        }


def upload(client: httpx.Client, **form: str) -> httpx.Response:
    files = {"file": ("prompt.wav", wav_bytes(2.0), "audio/wav")}
    return client.post("/v1/voices", files=files, data={"transcript": "Hello there.", **form})


def registered_ids(client: httpx.Client) -> list[str]:
    response = client.get("/v1/voices")
    assert response.status_code == 200, response.text
    return [record["id"] for record in response.json()["registered_voices"]]


def speak(client: httpx.Client, voice: str) -> httpx.Response:
    return client.post("/v1/tts", json={"text": "In this voice.", "voice": voice, "format": "wav", **SHORT})


def assert_error(response: httpx.Response, status: int, needle: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and set(error) == {"message", "type", "code", "param"}, error
    return error


def test_a_voice_is_its_keys_alone(served: tuple[str, Path], clients: dict[str, httpx.Client]) -> None:
    base_url, voices_dir = served
    alice, bob, admin = clients["alice"], clients["bob"], clients["admin"]
    response = upload(alice, name="alice's")
    assert response.status_code == 201, response.text
    record = response.json()
    voice = record["id"]
    assert record["shared"] is False and "owner" not in record
    stored = (voices_dir / f"{voice}.json").read_text()
    assert json.loads(stored)["owner"] == owner_id(ALICE.encode()) and ALICE not in stored  # never the key itself

    assert voice in registered_ids(alice) and voice in registered_ids(admin)
    assert voice not in registered_ids(bob)
    # To another key the voice does not exist: the answers of an id nobody registered.
    unknown = assert_error(speak(bob, UNKNOWN_VOICE), 404, "unknown voice")["message"]
    assert assert_error(speak(bob, voice), 404, "unknown voice")["message"] == unknown.replace(UNKNOWN_VOICE, voice)
    speech = {"model": "tiny", "input": "Hi.", "voice": voice, "response_format": "pcm"}
    assert_error(bob.post("/v1/audio/speech", json=speech), 404, "unknown voice")
    assert_error(bob.delete(f"/v1/voices/{voice}"), 404, "no registered voice")
    assert httpx.delete(f"{base_url}/v1/voices/{voice}", timeout=30).status_code == 401  # no key at all

    assert speak(alice, voice).status_code == 200
    assert speak(admin, voice).status_code == 200  # an admin key uses every voice...
    assert admin.delete(f"/v1/voices/{voice}").status_code == 200  # ...and deletes it
    assert voice not in registered_ids(alice)
    assert_error(speak(alice, voice), 404, "unknown voice")

    own = upload(alice).json()["id"]
    assert alice.delete(f"/v1/voices/{own}").status_code == 200


def test_shared_voices_are_everyones_and_only_admins_delete_them(
    served: tuple[str, Path], clients: dict[str, httpx.Client]
) -> None:
    _, voices_dir = served
    alice, bob, admin = clients["alice"], clients["bob"], clients["admin"]
    assert_error(upload(alice, shared="true"), 403, "only an admin key")
    response = upload(admin, name="house voice", shared="true")
    assert response.status_code == 201 and response.json()["shared"] is True, response.text
    voice = response.json()["id"]
    # As an operator's file of the older format would be: no owner field at all.
    record_path = voices_dir / f"{voice}.json"
    record = json.loads(record_path.read_text())
    del record["owner"]
    record_path.write_text(json.dumps(record))
    for client in (alice, bob):
        assert voice in registered_ids(client)
        assert speak(client, voice).status_code == 200
        assert_error(client.delete(f"/v1/voices/{voice}"), 403, "only an admin key may delete it")
    assert admin.delete(f"/v1/voices/{voice}").status_code == 200
    assert voice not in registered_ids(alice)


def test_one_key_cannot_fill_the_registry(clients: dict[str, httpx.Client]) -> None:
    alice, bob = clients["alice"], clients["bob"]
    added: dict[str, list[str]] = {"alice": [], "bob": []}
    for _ in range(VOICES_PER_KEY):
        response = upload(alice)
        assert response.status_code == 201, response.text
        added["alice"].append(response.json()["id"])
    assert_error(upload(alice), 409, f"this API key has registered {VOICES_PER_KEY} voices")
    response = upload(bob)
    assert response.status_code == 201, response.text
    added["bob"].append(response.json()["id"])
    for name, voices in added.items():
        for voice in voices:
            assert clients[name].delete(f"/v1/voices/{voice}").status_code == 200


def test_a_key_over_its_limit_gets_429_and_every_slot_comes_back(clients: dict[str, httpx.Client]) -> None:
    alice, bob = clients["alice"], clients["bob"]
    short = {"text": "Hi.", "voice": "dummy_female", "format": "pcm", **SHORT}
    long = {"text": LONG_TEXT, "voice": "dummy_female", **LONG_STREAM}
    with ExitStack() as streams:
        pieces = []
        for _ in range(LIMIT):
            response = streams.enter_context(alice.stream("POST", "/v1/tts", json=long))
            assert response.status_code == 200, response.read()
            pieces.append(response.iter_raw())  # held: dropping a half-read iterator would close the response
            assert next(pieces[-1])
        over = alice.post("/v1/tts", json=short)
        error = assert_error(over, 429, f"{LIMIT} requests in flight")
        assert over.headers["retry-after"] == f"{SERVED_RETRY_AFTER_S:g}" and error["code"] == "rate_limit_exceeded"
        assert bob.post("/v1/tts", json=short).status_code == 200  # another key is not held back
    # The streams' clients left: their slots come free.
    wait_until(lambda: alice.post("/v1/tts", json=short).status_code == 200, 30, "a slot freed by a disconnect")
    for _ in range(LIMIT + 1):  # failed requests give their slots back too
        assert_error(speak(alice, UNKNOWN_VOICE), 404, "unknown voice")
    statuses = [alice.post("/v1/tts", json=short).status_code for _ in range(LIMIT + 1)]
    assert statuses == [200] * (LIMIT + 1)


def test_cli_say_sends_the_api_key_from_its_option_or_the_environment(
    served: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base_url, _ = served
    out = tmp_path / "out.wav"
    say = ["say", "Hi.", "-o", str(out), "--url", base_url, "--seed", "1"]
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert cli_main(say) == 1 and "error 401" in capsys.readouterr().err
    assert cli_main([*say, "--api-key", ALICE]) == 0 and out.stat().st_size > 0
    monkeypatch.setenv(API_KEY_ENV, BOB)
    out.unlink()
    assert cli_main(say) == 0 and out.stat().st_size > 0


# --- Wyoming, keyless beside the keys ---------------------------------------------------------------------

WYOMING_READ_TIMEOUT_S = 60.0
TINY_RATE = 22050
TINY_LANGUAGES = ["zh", "en", "ja", "yue", "ko"]  # CosyVoice v1's


async def wyoming_exchange(port: int, sent: list[Event], last: str | None = None) -> list[Event]:
    """Send `sent` on a new connection, then read the server's events until one of type `last` (None: until the
    server closes the connection)."""
    received = []
    async with AsyncTcpClient("127.0.0.1", port, read_timeout=WYOMING_READ_TIMEOUT_S) as client:
        for event in sent:
            await client.write_event(event)
        while (event := await client.read_event()) is not None:
            received.append(event)
            if event.type == last:
                break
    return received


def wyoming(port: int, sent: list[Event], last: str | None = None) -> list[Event]:
    return asyncio.run(wyoming_exchange(port, sent, last))


def assert_audio(events: list[Event]) -> list[AudioChunk]:
    """`events` are one utterance: audio-start (16-bit mono at the model's rate), audio chunks, audio-stop."""
    assert [event.type for event in events] == ["audio-start", *["audio-chunk"] * (len(events) - 2), "audio-stop"]
    start = AudioStart.from_event(events[0])
    assert (start.rate, start.width, start.channels) == (TINY_RATE, 2, 1)
    chunks = [AudioChunk.from_event(event) for event in events[1:-1]]
    assert chunks and all(chunk.audio and len(chunk.audio) % 2 == 0 and chunk.rate == TINY_RATE for chunk in chunks)
    return chunks


def assert_error_event(events: list[Event], code: str, needle: str) -> None:
    """One `error` event, then the close."""
    assert [event.type for event in events] == ["error"], events
    assert events[0].data["code"] == code and needle in events[0].data["text"], events[0].data


def test_wyoming_clients_list_and_use_the_built_in_openai_and_shared_voices_only(
    served: tuple[str, Path], clients: dict[str, httpx.Client], wyoming_port: int
) -> None:
    base_url, _ = served
    alice, admin = clients["alice"], clients["admin"]
    private = upload(alice, name="alice's").json()["id"]
    shared = upload(admin, name="house voice", shared="true", openai_name="narrator").json()["id"]
    try:
        (info,) = wyoming(wyoming_port, [Describe().event()], "info")
        (program,) = Info.from_event(info).tts
        assert program.supports_synthesize_streaming and "tiny" in program.description
        voices = {voice.name: voice for voice in program.voices}
        assert {"dummy_female", "dummy_male", "alloy", "narrator", shared} <= voices.keys()
        assert private not in voices and voices[shared].description == "house voice"
        assert all(voice.installed and voice.languages == TINY_LANGUAGES for voice in voices.values())
        # The shared voice by its OpenAI name speaks; the key's private voice does not exist for a keyless client.
        assert_audio(wyoming(wyoming_port, [Synthesize("Hello.", SynthesizeVoice("narrator")).event()], "audio-stop"))
        refused = wyoming(wyoming_port, [Synthesize("Hello.", SynthesizeVoice(private)).event()])
        assert_error_event(refused, "UnknownVoiceError", "unknown voice")
    finally:
        assert alice.delete(f"/v1/voices/{private}").status_code == 200
        assert admin.delete(f"/v1/voices/{shared}").status_code == 200
    warnings = httpx.get(f"{base_url}/healthz", timeout=30).json()["warnings"]
    assert any("serves clients without an API key (wyoming.allow_keyless)" in warning for warning in warnings)


def test_wyoming_is_announced_by_mdns_as_home_assistant_discovers_it(
    served: tuple[str, Path], wyoming_port: int
) -> None:
    """On the interface the listener binds (loopback here), as a `_wyoming._tcp` service at its port."""
    assert mdns_service_on_loopback(service_name()) == (wyoming_port, ["127.0.0.1"])


def mdns_service_on_loopback(name: str, timeout_s: float = 10.0) -> tuple[int, list[str]] | None:
    """The port and IPv4 addresses an mDNS responder on loopback gives for the service `name` (None: no answer).

    Asked as a one-shot query from a port of its own (RFC 6762 section 6.7), which is answered to that port: a
    multicast querier's answers go to port 5353, which every mDNS socket on this machine shares (SO_REUSEPORT), and
    the kernel may hand one sent by unicast to another process's socket."""
    query = DNSOutgoing(_FLAGS_QR_QUERY)
    query.add_question(DNSQuestion(name, _TYPE_SRV, _CLASS_IN))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as querier:
        querier.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        querier.bind(("127.0.0.1", 0))
        querier.settimeout(0.5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for packet in query.packets():
                querier.sendto(packet, (MDNS_GROUP, 5353))
            with contextlib.suppress(TimeoutError):
                records = DNSIncoming(querier.recv(9000)).answers()
                ports = [record.port for record in records if isinstance(record, DNSService) and record.name == name]
                if ports:
                    addresses = [record.address for record in records if isinstance(record, DNSAddress)]
                    return ports[0], [socket.inet_ntoa(address) for address in addresses]
    return None


def test_wyoming_synthesize_answers_pcm_chunk_by_chunk_and_a_connection_takes_several(wyoming_port: int) -> None:
    first = Synthesize("Hello there. This is spoken over Wyoming.", SynthesizeVoice("alloy")).event()
    events = asyncio.run(wyoming_exchange_twice(wyoming_port, first, Synthesize("And again.").event()))
    chunks = assert_audio(events[0])
    assert len(chunks) >= 2  # each sentence's audio as it is decoded, not one file at the end
    assert_audio(events[1])  # no voice: the model's default


async def wyoming_exchange_twice(port: int, first: Event, second: Event) -> list[list[Event]]:
    """Two syntheses on one connection, one after the other."""
    utterances = []
    async with AsyncTcpClient("127.0.0.1", port, read_timeout=WYOMING_READ_TIMEOUT_S) as client:
        for event in (first, second):
            await client.write_event(event)
            utterance = []
            while (received := await client.read_event()) is not None:
                utterance.append(received)
                if received.type == "audio-stop":
                    break
            utterances.append(utterance)
    return utterances


def test_a_wyoming_text_stream_speaks_its_first_sentence_before_its_text_ends(wyoming_port: int) -> None:
    async def exchange() -> tuple[list[Event], list[Event]]:
        async with AsyncTcpClient("127.0.0.1", wyoming_port, read_timeout=WYOMING_READ_TIMEOUT_S) as client:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice("dummy_male")).event())
            await client.write_event(SynthesizeChunk("Hello there. ").event())
            # The first sentence is whole: its audio comes while the rest is still to be written (or this times out).
            early = [await client.read_event() for _ in range(2)]
            for piece in ("And a second", " sentence."):
                await client.write_event(SynthesizeChunk(piece).event())
            # Home Assistant repeats the whole text for servers without streaming: not spoken again.
            await client.write_event(Synthesize("Hello there. And a second sentence.").event())
            await client.write_event(SynthesizeStop().event())
            rest = []
            while (event := await client.read_event()) is not None:
                rest.append(event)
                if event.type == "synthesize-stopped":
                    break
            return early, rest

    early, rest = asyncio.run(exchange())
    assert [event.type for event in early] == ["audio-start", "audio-chunk"]
    types = [event.type for event in rest]
    assert types[-2:] == ["audio-stop", "synthesize-stopped"] and set(types[:-2]) == {"audio-chunk"}, types


@pytest.mark.parametrize(
    ("sent", "code", "needle"),
    [
        ([Synthesize("Hi.", SynthesizeVoice("nobody")).event()], "UnknownVoiceError", "unknown voice 'nobody'"),
        ([Synthesize("  ").event()], "InvalidInputError", "the input text is empty"),
        ([Synthesize("<speak>Hi.</speak>", text_format="ssml").event()], "InvalidInputError", "send plain text"),
        ([SynthesizeChunk("Hi.").event()], "InvalidInputError", "send synthesize-start first"),
        ([SynthesizeStart().event(), SynthesizeStop().event()], "InvalidInputError", "nothing to speak"),
        ([Event("synthesize", {"text": 42})], "InvalidInputError", '"text", a string'),
        # What a browser page can send to the port: an HTTP request, whose first line is no event header.
        (b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", "InvalidInputError", "header is not JSON"),
        (b'{"type": "synthesize", "data_length": 1099511627776}\n', "InvalidInputError", "data_length must be"),
    ],
)
def test_wyoming_answers_bad_input_with_an_error_event_and_a_close(
    wyoming_port: int, sent: list[Event] | bytes, code: str, needle: str
) -> None:
    async def raw_exchange(data: bytes) -> list[Event]:
        reader, writer = await asyncio.open_connection("127.0.0.1", wyoming_port)
        writer.write(data)
        events = []
        while (event := await asyncio.wait_for(async_read_event(reader), WYOMING_READ_TIMEOUT_S)) is not None:
            events.append(event)
        writer.close()
        return events

    events = asyncio.run(raw_exchange(sent)) if isinstance(sent, bytes) else wyoming(wyoming_port, sent)
    assert_error_event(events, code, needle)


def test_a_wyoming_connection_that_stalls_inside_an_event_is_closed_after_the_idle_time() -> None:
    """On the listener alone, with a short idle time (the app's is TEXT_STREAM_IDLE_S): the stall never reaches the
    ingress."""

    async def stall() -> tuple[list[Event], float]:
        listener = WyomingListener(None, EVERYONE, LimitsArgs(), idle_s=IDLE_S)
        port = free_port()
        await listener.start("127.0.0.1", port)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b'{"type": "synthe')  # and nothing more
            started = asyncio.get_running_loop().time()
            events = []
            while (event := await asyncio.wait_for(async_read_event(reader), WYOMING_READ_TIMEOUT_S)) is not None:
                events.append(event)
            writer.close()
            return events, asyncio.get_running_loop().time() - started
        finally:
            assert listener.server is not None
            listener.server.close()

    events, closed_after_s = asyncio.run(stall())
    assert_error_event(events, "StreamIdleError", "no audio in the making")
    assert IDLE_S - 0.5 < closed_after_s < IDLE_S + 5  # its clock starts at the connection, just before


def test_a_wyoming_client_that_leaves_mid_stream_is_cancelled_while_others_are_served(wyoming_port: int) -> None:
    decoder = serve.get_deployment_handle("Decoder", "tenancy")
    before = decoder.batch_stats.remote().result()["cancelled"]
    many_sentences = " ".join(f"Sentence {number} of a long text goes on." for number in range(80))

    async def leave_after_first_audio() -> list[Event]:
        async with AsyncTcpClient("127.0.0.1", wyoming_port, read_timeout=WYOMING_READ_TIMEOUT_S) as client:
            await client.write_event(Synthesize(many_sentences).event())
            first = [await client.read_event() for _ in range(2)]
            assert [event.type for event in first] == ["audio-start", "audio-chunk"]  # the decode is under way
            # another client is served meanwhile
            return await wyoming_exchange(wyoming_port, [Synthesize("Next, please.").event()], "audio-stop")
        # leaving the block closed the connection mid-stream

    assert_audio(asyncio.run(leave_after_first_audio()))
    wait_until(lambda: decoder.batch_stats.remote().result()["live"] == 0, 60, "the left synthesis to leave the loop")
    assert decoder.batch_stats.remote().result()["cancelled"] > before  # cancelled, not decoded to its end
