"""The whole application on a real (local, CPU) Ray Serve with the tiny model: every endpoint end to end."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from tests.serve.conftest import decode_audio_file

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from autoscaling.metrics import METRIC_NAMES  # noqa: E402
from serve_app.audio import FORMATS, OPENAI_SAMPLE_RATE  # noqa: E402
from serve_app.cli import main as cli_main  # noqa: E402
from serve_app.ingress import TTSIngress, build_app_with_overrides  # noqa: E402
from serve_app.request_args import DEFAULT_OPENAI_VOICES, LimitsArgs  # noqa: E402
from tests.serve.conftest import on_cpus, text_stream_exchange, wait_until_healthy  # noqa: E402

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

APP_NAME = "tts-test"
BROKEN_APP = "tts-broken"
SECRET = "secret-internal-detail-/opt/model/state"
MAX_INPUT_CHARS = 600
LONG_TEXT_CHARS = 120
# Dummy weights rarely emit EOS: a small token/text ratio keeps every decode short on 2 CPUs.
SHORT = {"sampling": {"max_token_text_ratio": 3.0}}
LONG_TEXT = " ".join(
    f"This is sentence number {n} of a long text that the frontend has to split into several segments."
    for n in range(1, 5)
)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class BrokenStage:
    """Stands for the encoder: every call fails with an exception whose text must never reach a client."""

    def info(self) -> None:
        raise RuntimeError(SECRET)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": "tiny",
        # A long batch window so that concurrent requests provably share batches.
        "decoder": {"num_cpus": 0.5, "max_batch_size": 4, "batch_wait_timeout_s": 0.5},
        "limits": {"max_input_chars": MAX_INPUT_CHARS, "long_text_chars": LONG_TEXT_CHARS},
    }
    serve.run(build_app_with_overrides(args, on_cpus(TTSIngress=0.25, Encoder=0.25)), name=APP_NAME, route_prefix="/")
    # An ingress whose other stages fail in unexpected ways, beside it, for the generic 500s.
    broken = BrokenStage.bind()
    serve.run(TTSIngress.bind(broken, broken, "broken", LimitsArgs()), name=BROKEN_APP, route_prefix="/broken")
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def info(client: httpx.Client) -> dict[str, Any]:
    response = client.get("/v1/voices")
    assert response.status_code == 200
    return response.json()


def _decode(data: bytes) -> tuple[np.ndarray, int]:
    audio, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert audio.ndim == 1 and len(audio) > 0 and np.isfinite(audio).all()
    return audio, rate


def _batch_size_counts() -> Counter[int]:
    stats = serve.get_deployment_handle("Decoder", APP_NAME).batch_stats.remote().result()
    return Counter(stats["batch_size_counts"])


def test_healthz_reports_both_stages_running(client: httpx.Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    running = response.json()["running_replicas"]
    assert running["Encoder"] >= 1 and running["Decoder"] >= 1


def test_models_and_voices(client: httpx.Client, info: dict[str, Any]) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny", "tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
    assert info["voices"] and all(isinstance(v, str) for v in info["voices"])
    assert info["sample_rate"] > 0 and set(info["formats"]) == set(FORMATS)
    assert set(info["stream_formats"]) == set(FORMATS) - {"flac"}
    assert info["openai_voices"] == DEFAULT_OPENAI_VOICES and set(info["openai_voices"].values()) <= set(info["voices"])
    assert info["instructions"] == "none" and info["voice_cloning"] is False


def test_native_tts_every_format(client: httpx.Client, info: dict[str, Any]) -> None:
    for name in FORMATS:
        body = {"text": "Hello there.", "voice": info["voices"][0], "format": name, "seed": 3, **SHORT}
        response = client.post("/v1/tts", json=body)
        assert response.status_code == 200, response.text
        assert response.headers["x-sample-rate"] == str(info["sample_rate"])  # the native API keeps the model's rate
        if name == "pcm":
            assert len(response.content) > 0 and len(response.content) % 2 == 0
            continue
        _, rate = decode_audio_file(response.content)
        assert rate == info["sample_rate"] or name == "opus"


def test_native_tts_seed_reproducible(client: httpx.Client, info: dict[str, Any]) -> None:
    body = {"text": "Same seed, same audio.", "voice": info["voices"][-1], "format": "pcm", "seed": 11, **SHORT}
    first, second = (client.post("/v1/tts", json=body) for _ in range(2))
    assert first.status_code == second.status_code == 200
    assert first.content == second.content


def test_stream_chunks_arrive_one_by_one(client: httpx.Client, info: dict[str, Any]) -> None:
    body = {"text": LONG_TEXT, "voice": info["voices"][0], "format": "wav", "stream": True, "seed": 5, **SHORT}
    pieces: list[bytes] = []
    with client.stream("POST", "/v1/tts", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("audio/wav")
        pieces.extend(piece for piece in response.iter_raw() if piece)
    assert len(pieces) > 1, "the long text should arrive as several chunks"
    _, rate = _decode(b"".join(pieces))
    assert rate == info["sample_rate"]
    # The same request without streaming (the long-text path) gives the same samples.
    whole = client.post("/v1/tts", json={**body, "stream": False})
    assert whole.status_code == 200
    np.testing.assert_allclose(_decode(whole.content)[0], _decode(b"".join(pieces))[0], atol=1e-4)


def test_concurrent_requests_share_batches(base_url: str, info: dict[str, Any]) -> None:
    before = _batch_size_counts()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            bodies = [
                {"text": f"Request {i} says hi.", "voice": info["voices"][0], "seed": i, **SHORT} for i in range(4)
            ]
            return await asyncio.gather(*(http.post("/v1/tts", json=body) for body in bodies))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 4
    for response in responses:
        _decode(response.content)
    new_batches = _batch_size_counts() - before
    assert sum(size * count for size, count in new_batches.items()) >= 4
    assert max(new_batches) > 1, f"no batch larger than 1 was formed: {dict(new_batches)}"


def test_decoder_reports_autoscaling_numbers() -> None:
    stats = serve.get_deployment_handle("Decoder", APP_NAME).record_autoscaling_stats.remote().result()
    assert set(stats) == set(METRIC_NAMES)
    assert all(isinstance(value, float) for value in stats.values())
    assert 0.0 <= stats["utilization"] <= 1.0 and 0.0 <= stats["batch_fill"] <= 1.0
    assert stats["first_audio_wait_s"] == 0.0  # every request so far got its audio (or left): none still waits


def test_openai_client_round_trip(base_url: str, info: dict[str, Any]) -> None:
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="not-needed", max_retries=0)
    speech = api.audio.speech.create(model="tiny", voice=info["voices"][0], input="Hi.", response_format="wav")
    _, rate = _decode(speech.content)
    assert rate == OPENAI_SAMPLE_RATE != info["sample_rate"]  # OpenAI's rate, from the tiny v1 model's 22050 Hz
    with api.audio.speech.with_streaming_response.create(
        model="tiny", voice=info["voices"][1 % len(info["voices"])], input="Hi.", response_format="flac", speed=1.5
    ) as response:
        _decode(response.read())
    with pytest.raises(openai.NotFoundError, match="unknown voice"):
        api.audio.speech.create(model="tiny", voice="no-such-voice", input="Hi.")
    with pytest.raises(openai.BadRequestError, match="speed"):
        api.audio.speech.create(model="tiny", voice=info["voices"][0], input="Hi.", speed=4.5)
    with pytest.raises(openai.NotFoundError, match=r"unknown model 'tts-2'.*'tiny', 'tts-1', 'tts-1-hd'"):
        api.audio.speech.create(model="tts-2", voice=info["voices"][0], input="Hi.")


def test_openai_code_runs_unchanged_with_model_and_voice_names(
    base_url: str, info: dict[str, Any], tmp_path: Path
) -> None:
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="not-needed", max_retries=0)
    for model in ("tts-1", "tts-1-hd"):
        speech = api.audio.speech.create(model=model, voice="alloy", input="Hi.", response_format="wav")
        assert decode_audio_file(speech.content)[1] == OPENAI_SAMPLE_RATE
    # The migration snippet of the README (its "Moving from OpenAI").
    with api.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="coral", input="Hello from CosyVoice.", response_format="mp3"
    ) as response:
        response.stream_to_file(tmp_path / "hello.mp3")
    assert decode_audio_file((tmp_path / "hello.mp3").read_bytes())[1] == OPENAI_SAMPLE_RATE


def test_current_openai_names_speed_range_and_fields_work_unchanged(base_url: str, info: dict[str, Any]) -> None:
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="not-needed", max_retries=0)
    for model, voice in (("gpt-4o-mini-tts-2025-12-15", "marin"), ("tts-1-1106", "cedar"), ("tts-1-hd-1106", "alloy")):
        speech = api.audio.speech.create(model=model, voice=voice, input="Hi.", response_format="wav")
        assert _decode(speech.content)[1] == OPENAI_SAMPLE_RATE
    # OpenAI's speed range, an empty instruction (absent), and a field a newer client may send
    for speed in (0.25, 4.0):
        api.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="wav", speed=speed)
    api.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="wav", instructions="")
    api.audio.speech.create(
        model="tts-1", voice="alloy", input="Hi.", response_format="wav", extra_body={"a_future_field": {"x": 1}}
    )
    with pytest.raises(openai.NotFoundError, match="unknown model 'tts-1-20251215'"):
        api.audio.speech.create(model="tts-1-20251215", voice="alloy", input="Hi.")


NODE_REQUESTS = Path(__file__).parents[1] / "fixtures" / "openai_node_requests.json"


def test_the_openai_node_sdks_requests_work(client: httpx.Client) -> None:
    """The requests openai-node 6.49 sends for `audio.speech.create` (recorded: the suite needs no Node), replayed
    with their headers: an object voice, an empty instruction, a snapshot model, sse."""
    for recorded in json.loads(NODE_REQUESTS.read_text())["requests"]:
        response = client.post(recorded["path"], json=recorded["body"], headers=recorded["headers"])
        assert response.status_code == 200, (recorded["body"], response.text)
        assert response.headers["x-sample-rate"] == str(OPENAI_SAMPLE_RATE)
        if recorded["body"].get("stream_format") == "sse":
            assert '"type": "speech.audio.done"' in response.text
        elif recorded["body"].get("response_format", "mp3") != "pcm":
            assert decode_audio_file(response.content)[1] == OPENAI_SAMPLE_RATE


# Clients built on OpenAI's speech endpoint, each with its defaults but the base URL. They are not in the `test`
# extra (docs/clients.md: how to run these), so each test skips where its package is not installed. pipecat cannot
# share Ray's environment: tests/clients/test_pipecat_client.py.


def _pcm_seconds(pcm: bytes) -> float:
    """The length of OpenAI's `pcm` (24 kHz 16-bit mono)."""
    assert len(pcm) % 2 == 0
    return len(pcm) / 2 / OPENAI_SAMPLE_RATE


def test_the_openai_agents_tts_model_with_its_default_settings_gets_audio(base_url: str) -> None:
    """Its default settings send `instructions`, which the tiny model cannot follow: spoken without them."""
    voice = pytest.importorskip("agents.voice")

    async def speak() -> bytes:
        provider = voice.OpenAIVoiceModelProvider(base_url=f"{base_url}/v1", api_key="not-needed")
        model = provider.get_tts_model(None)  # its default model, gpt-4o-mini-tts
        return b"".join([chunk async for chunk in model.run("Hello from an agent.", voice.TTSModelSettings())])

    assert _pcm_seconds(asyncio.run(speak())) > 0


def test_livekits_openai_plugin_through_its_stream_adapter_gets_audio(base_url: str) -> None:
    """The plugin is not streaming (one request per text): an agent wraps it in a StreamAdapter, which sends each
    sentence run its tokenizer cuts; by default gpt-4o-mini-tts, ash, mp3 and `stream_format` sse."""
    livekit_tts = pytest.importorskip("livekit.agents.tts")
    from livekit.plugins import openai as livekit_openai

    async def speak() -> list[Any]:
        model = livekit_openai.TTS(base_url=f"{base_url}/v1", api_key="not-needed")
        adapter = livekit_tts.StreamAdapter(tts=model)
        stream = adapter.stream()
        stream.push_text("Hello from LiveKit. And a second sentence.")
        stream.end_input()
        audio = [event.frame async for event in stream]
        for closing in (stream, adapter, model):
            await closing.aclose()
        return audio

    audio = asyncio.run(speak())
    assert sum(frame.samples_per_channel for frame in audio) > 0
    assert {frame.sample_rate for frame in audio} == {OPENAI_SAMPLE_RATE}


def test_litellm_speech_gets_audio(base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Else its import fetches a price list from GitHub, retrying for seconds where there is no network.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    response = litellm.speech(
        model="openai/tts-1", voice="alloy", input="Hello from litellm.", api_base=f"{base_url}/v1", api_key="x"
    )
    audio, rate = decode_audio_file(response.content)  # mp3, OpenAI's default
    assert len(audio) > 0 and rate == OPENAI_SAMPLE_RATE


def test_a_validation_error_names_its_param(client: httpx.Client) -> None:
    body = {"model": "tts-1", "input": "Hi.", "voice": "alloy", "speed": 9}
    error = client.post("/v1/audio/speech", json=body).json()["error"]
    assert error["param"] == "speed" and "speed:" in error["message"]


def test_an_openai_voice_name_is_the_voice_it_maps_to(client: httpx.Client) -> None:
    for name, voice in (("alloy", DEFAULT_OPENAI_VOICES["alloy"]), ("onyx", DEFAULT_OPENAI_VOICES["onyx"])):
        bodies = [{"text": "Mapped.", "voice": v, "format": "pcm", "seed": 4, **SHORT} for v in (name, voice)]
        mapped, direct = (client.post("/v1/tts", json=body) for body in bodies)
        assert mapped.status_code == direct.status_code == 200
        assert mapped.content == direct.content


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
@pytest.mark.parametrize("response_format", sorted(FORMATS))
def test_every_format_and_stream_format_through_the_openai_client(
    base_url: str, info: dict[str, Any], response_format: str, stream_format: str
) -> None:
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="not-needed", max_retries=0)
    with api.audio.speech.with_streaming_response.create(
        model="tts-1", voice="nova", input="Hi.", response_format=response_format, stream_format=stream_format
    ) as response:
        media_type = response.headers["content-type"]
        body = b"".join(response.iter_bytes())
    if stream_format == "sse":
        assert media_type.startswith("text/event-stream")
        events = [json.loads(line[len("data: ") :]) for line in body.decode().splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
        assert events[:-1] and all(event["type"] == "speech.audio.delta" for event in events[:-1])
        data = b"".join(base64.b64decode(event["audio"]) for event in events[:-1])
        if not FORMATS[response_format].streamable:
            assert len(events) == 2  # the whole file in one delta, once synthesis ends
    else:
        assert media_type == FORMATS[response_format].media_type
        data = body
    if response_format == "pcm":
        assert len(data) > 0 and len(data) % 2 == 0
        return
    audio, rate = decode_audio_file(data)
    assert rate == OPENAI_SAMPLE_RATE or response_format == "opus"  # Opus decoders give 48 kHz
    assert response.headers["x-sample-rate"] == str(OPENAI_SAMPLE_RATE)
    assert len(audio) > 0 and np.isfinite(audio).all()


def http_chunks(base_url: str, path: str, body: dict[str, Any]) -> list[bytes]:
    """The body of a POST as the server framed it (HTTP/1.1 chunked transfer coding): one entry per chunk sent,
    however the network later merged them, which a client's reads (`iter_bytes`) do not tell."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=120) as connection:
        connection.sendall(head.encode() + payload)
        received = b"".join(iter(lambda: connection.recv(65536), b""))
    headers, _, rest = received.partition(b"\r\n\r\n")
    assert headers.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in headers.lower(), headers
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return chunks
        chunks.append(rest[:size])
        rest = rest[size + 2 :]  # the chunk and its CRLF


def test_the_openai_streaming_response_gives_more_than_one_chunk(base_url: str, info: dict[str, Any]) -> None:
    # About 8 text tokens: up to 160 speech tokens, past the first 120-token chunk of the v1 stream.
    speech = {"model": "tts-1", "voice": "echo", "input": "Streaming in more than one chunk.", "response_format": "mp3"}
    chunks = http_chunks(base_url, "/v1/audio/speech", speech)
    assert len(chunks) > 1, "the body was sent in one piece: it was not streamed"
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="not-needed", max_retries=0)
    with api.audio.speech.with_streaming_response.create(**speech) as response:
        streamed = b"".join(response.iter_bytes())
    assert len(decode_audio_file(streamed)[0]) > 0


def test_instructions_a_model_cannot_follow_are_ignored_as_tts_1_does_and_said(base_url: str) -> None:
    """The tiny v1 model follows no instructions: OpenAI's endpoint and the text stream speak without them and say so
    (openai.strict_instructions gives the 400 back: tests/serve/test_openai_client_compat.py)."""
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="not-needed", max_retries=0)
    for stream_format in ("audio", "sse"):
        response = api.audio.speech.with_raw_response.create(
            model="tts-1", voice="alloy", input="Hi.", instructions="Speak softly.", stream_format=stream_format
        )
        assert response.headers["x-instructions"] == "ignored"
        assert "cannot follow instructions" in response.headers["x-instructions-reason"]
        if stream_format == "sse":
            assert b'"type": "speech.audio.done"' in response.content
        else:
            assert len(decode_audio_file(response.content)[0]) > 0  # spoken
    start = {"type": "start", "model": "tts-1", "voice": "alloy", "response_format": "pcm", "instructions": "Softly."}
    events, audio, code = asyncio.run(
        text_stream_exchange(base_url, [start, {"type": "text", "text": "Hi."}, {"type": "end"}])
    )
    assert code == 1000 and audio and events[-1]["type"] == "speech.audio.done", events
    assert events[-1]["instructions"] == "ignored" and "cannot follow" in events[-1]["instructions_reason"]


def test_open_webui_fills_its_menus_from_the_audio_lists(client: httpx.Client, info: dict[str, Any]) -> None:
    """As Open WebUI's OpenAI engine reads `{base}/audio/models` and `{base}/audio/voices`."""
    models = client.get("/v1/audio/models").json().get("models", [])
    assert [model["id"] for model in models] == ["tiny", "tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
    voices = {voice["id"]: voice["name"] for voice in client.get("/v1/audio/voices").json().get("voices", [])}
    assert list(voices) == [*info["voices"], *DEFAULT_OPENAI_VOICES]  # no voice registered on this server


def test_native_instruct_text_to_a_model_that_cannot_follow_it_is_a_400(client: httpx.Client) -> None:
    for stream in (False, True):
        body = {"text": "Hi.", "instruct_text": "Speak softly.", "stream": stream}
        response = client.post("/v1/tts", json=body)
        assert response.status_code == 400 and "cannot follow instructions" in response.json()["error"]["message"]


def test_an_internal_failure_reaches_the_client_as_a_generic_500(client: httpx.Client) -> None:
    request_id = "forced-failure-1"
    for method, path, body in (("GET", "/broken/v1/voices", None), ("POST", "/broken/v1/tts", {"text": "Hi."})):
        response = client.request(method, path, json=body, headers={"X-Request-ID": request_id})
        assert response.status_code == 500
        assert response.json()["error"] == {
            "message": f"internal error (request id {request_id})",
            "type": "server_error",
            "code": "internal_error",
            "param": None,
        }
        assert SECRET not in response.text and "RuntimeError" not in response.text
        assert response.headers["x-request-id"] == request_id
    # The ingress's log line carries the same id and the traceback.
    logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    lines = [
        json.loads(line)
        for log in logs_dir.glob(f"replica_{BROKEN_APP}_TTSIngress_*.log")
        for line in log.read_text().splitlines()
        if line.startswith("{")
    ]
    failures = [line for line in lines if line.get("request_id") == request_id and line["message"] == "internal error"]
    assert failures and all("Traceback" in line["exc_text"] and SECRET in line["exc_text"] for line in failures)


def test_openai_sse_stream(client: httpx.Client, info: dict[str, Any]) -> None:
    body = {
        "model": "tiny",
        "input": "Hi.",
        "voice": info["voices"][0],
        "response_format": "pcm",
        "stream_format": "sse",
    }
    with client.stream("POST", "/v1/audio/speech", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: ") :]) for line in response.iter_lines() if line.startswith("data: ")]
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    deltas = events[:-1]
    assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(pcm) > 0 and len(pcm) % 2 == 0
    # OpenAI's schema requires usage: the text tokens read, the audio in speech tokens (50 a second for v1)
    usage = done["usage"]
    assert usage["input_tokens"] > 0
    # the pcm is OpenAI's raw 24 kHz; resampling keeps the length within a few samples
    assert abs(usage["output_tokens"] - len(pcm) / 2 / OPENAI_SAMPLE_RATE * 50) <= 1
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


BAD_REQUESTS = [
    ("empty input", {"text": "   "}, 400, "empty"),
    ("too long", {"text": "x" * (MAX_INPUT_CHARS + 1)}, 400, "limit"),
    ("unknown voice", {"text": "Hi.", "voice": "no-such-voice"}, 404, "unknown voice"),
    ("bad format", {"text": "Hi.", "format": "ogg"}, 400, "ogg"),
    ("unstreamable format", {"text": "Hi.", "format": "flac", "stream": True}, 400, "streamed"),
    ("speed too high", {"text": "Hi.", "speed": 4.5}, 400, "speed"),
    ("speed too low", {"text": "Hi.", "speed": 0.1}, 400, "speed"),
    ("bad sampling", {"text": "Hi.", "sampling": {"top_p": 2.0}}, 400, "top_p"),
    ("unknown field", {"text": "Hi.", "temperature": 0.3}, 400, "temperature"),
    ("missing text", {"voice": "x"}, 400, "text"),
]


@pytest.mark.parametrize(("body", "status", "needle"), [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_a_json_error(client: httpx.Client, body: dict[str, Any], status: int, needle: str) -> None:
    response = client.post("/v1/tts", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


HOSTILE_NUMBERS = [  # raw JSON: Python's parser takes NaN and Infinity, and integers of any length
    ("/v1/tts", '{"text": "Hi.", "sampling": {"min_token_text_ratio": NaN}}', "sampling.min_token_text_ratio"),
    ("/v1/tts", '{"text": "Hi.", "speed": Infinity}', "speed"),
    ("/v1/tts", '{"text": "Hi.", "sampling": {"win_size": 1' + "0" * 400 + "}}", "sampling.win_size"),
    ("/v1/tts", '{"text": "Hi.", "sampling": {"top_k": 100000}}', "sampling.top_k"),
    ("/v1/tts", '{"text": "Hi.", "sampling": {"max_token_text_ratio": 100000}}', "sampling.max_token_text_ratio"),
    ("/v1/tts", '{"text": "Hi.", "seed": 1' + "0" * 30 + "}", "seed"),
    ("/v1/audio/speech", '{"model": "tiny", "input": "Hi.", "voice": "alloy", "speed": -Infinity}', "speed"),
]


@pytest.mark.parametrize(("path", "raw", "field"), HOSTILE_NUMBERS, ids=[h[2] for h in HOSTILE_NUMBERS])
def test_non_finite_or_unbounded_numbers_get_a_400_naming_the_field(
    client: httpx.Client, path: str, raw: str, field: str
) -> None:
    response = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert f"{field}:" in response.json()["error"]["message"]


def test_malformed_json_gets_a_json_error(client: httpx.Client) -> None:
    for path in ("/v1/tts", "/v1/audio/speech"):
        response = client.post(path, content=b'{"text": "Hi.",', headers={"content-type": "application/json"})
        assert response.status_code == 400
        assert "malformed JSON" in response.json()["error"]["message"]


def test_unknown_route_is_a_json_404(client: httpx.Client) -> None:
    response = client.get("/v1/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_cli_say(base_url: str, tmp_path: Any, info: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.wav"
    assert cli_main(["say", "Hi.", "-o", str(out), "--url", base_url, "--seed", "1"]) == 0
    _, rate = _decode(out.read_bytes())
    assert rate == info["sample_rate"]
    assert cli_main(["say", "Hi.", "-o", str(tmp_path / "x.wav"), "--url", base_url, "--voice", "nobody"]) == 1
    assert "unknown voice" in capsys.readouterr().err
