"""The try-it page at GET /: served with its assets, and driven in headless Chromium against a real Serve app; and
the text stream WebSocket the page speaks through as the user types (`/v1/audio/speech/stream`), driven by the
example client `examples/stream_text_ws.py` and by hand.

The server has API keys on and voice cloning (the tiny preset's shipped models), so the page is used as a user of
such a server would: key typed once into the page, voices registered from a file or the (fake) microphone.

The browser tests use Playwright with the system Chromium (Debian's `chromium`; `$COSYVOICE_BROWSER` points at
another binary) and skip, saying why, where Playwright or the browser is missing. They check that the audio
data arrives and is scheduled for playback, not that it is heard: a headless machine may have no sound device.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import importlib.util
import io
import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets

pytest.importorskip("ray")
from ray import serve

from serve_app.guard import WEBSOCKET_KEY_PROTOCOL_PREFIX, WEBSOCKET_PROTOCOL
from tests.serve.conftest import on_cpus, running_app, wait_until

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Headless, and nothing that reaches outside the machine (updates, sync, QUIC probes).
BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # A fake microphone (a beep), granted without a prompt: the page's MediaRecorder path.
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
]
API_KEY = "page-test-key-0123456789"
APP = "tts-web-test"
KEY_STORAGE = "cosyvoice-api-key"  # serve_app/static/app.js
PROMPT_SAMPLE_RATE = 16000
WAIT_MS = 30_000
SYNTHESIS_WAIT_MS = 180_000  # a 2-CPU machine decodes the tiny model a few times slower than real time
WAV_HEADER_BYTES = 44  # serve_app.audio.streaming_wav_header
PCM_BYTES_PER_SAMPLE = 2


def _browser_path() -> str | None:
    explicit = os.environ.get("COSYVOICE_BROWSER")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return next((path for name in BROWSER_NAMES if (path := shutil.which(name))), None)


def _prompt_wav(seconds: float = 2.0) -> bytes:
    t = np.arange(int(seconds * PROMPT_SAMPLE_RATE)) / PROMPT_SAMPLE_RATE
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), PROMPT_SAMPLE_RATE, format="WAV")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = {
        "model": "tiny",
        "decoder": {"num_cpus": 0.5},
        "security": {"api_keys": [API_KEY]},
        "voices_dir": str(tmp_path_factory.mktemp("voices")),
    }
    with running_app(args, APP, deployments=on_cpus(TTSIngress=0.25, Encoder=0.25)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[httpx.Client]:
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=base_url, timeout=60, headers=headers) as http:
        yield http


@pytest.fixture(scope="module")
def info(client: httpx.Client) -> dict[str, Any]:
    return client.get("/v1/voices").json()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install .[browser])")
    executable = _browser_path()
    if executable is None:
        pytest.skip(f"no Chromium found (looked for {', '.join(BROWSER_NAMES)} and $COSYVOICE_BROWSER)")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=BROWSER_ARGS, timeout=WAIT_MS)
        try:
            yield launched
        finally:
            launched.close()


def _open_page(browser: Any, base_url: str, api_key: str | None) -> Iterator[Any]:
    """The page in a new browser context, its local storage holding `api_key` (None: a first visit)."""
    context = browser.new_context()
    if api_key is not None:
        context.add_init_script(f"localStorage.setItem({KEY_STORAGE!r}, {api_key!r})")
    opened = context.new_page()
    opened.set_default_timeout(WAIT_MS)
    console_errors: list[str] = []
    opened.on("pageerror", lambda error: console_errors.append(str(error)))
    opened.goto(f"{base_url}/")
    opened.wait_for_function("document.getElementById('status').dataset.state !== 'idle'")
    try:
        yield opened
    finally:
        context.close()
    assert not console_errors, f"uncaught errors in the page: {console_errors}"


@pytest.fixture
def page(browser: Any, base_url: str) -> Iterator[Any]:
    yield from _open_page(browser, base_url, API_KEY)


@pytest.fixture
def first_visit_page(browser: Any, base_url: str) -> Iterator[Any]:
    yield from _open_page(browser, base_url, None)


def _speak(page: Any, text: str) -> str:
    """Type `text`, press Speak, wait for the request to end; the final status state."""
    page.fill("#text", text)
    page.click("#speak")
    page.wait_for_function(
        "['done', 'error'].includes(document.getElementById('status').dataset.state)", timeout=SYNTHESIS_WAIT_MS
    )
    return page.get_attribute("#status", "data-state")


def _download(page: Any) -> bytes:
    """The bytes behind the page's download link (a blob: URL, so fetched inside the page)."""
    encoded = page.evaluate(
        """async () => {
            const bytes = new Uint8Array(await (await fetch(document.getElementById('download').href)).arrayBuffer());
            let text = '';
            for (const byte of bytes) text += String.fromCharCode(byte);
            return btoa(text);
        }"""
    )
    return base64.b64decode(encoded)


def test_page_and_assets_are_served_without_a_key(base_url: str) -> None:
    client = httpx.Client(base_url=base_url, timeout=60)  # no key: the page must load to ask for one
    assert client.get("/v1/voices").status_code == 401
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="speak"' in page.text and 'src="static/app.js"' in page.text
    script = client.get("/static/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "v1/tts" in script.text
    style = client.get("/static/style.css")
    assert style.status_code == 200 and style.headers["content-type"].startswith("text/css")
    for icon in ("/favicon.ico", "/static/favicon.svg"):  # browsers ask for /favicon.ico unless told otherwise
        response = client.get(icon)
        assert response.status_code == 200 and response.headers["content-type"].startswith("image/svg+xml")
    missing = client.get("/static/no-such-file.js")
    assert missing.status_code == 404 and missing.json()["error"]["message"]


def test_pickers_are_filled_from_the_api(page: Any, info: dict[str, Any]) -> None:
    assert page.get_attribute("#status", "data-state") == "ready"
    voices = page.eval_on_selector_all("#voice optgroup[label=built-in] option", "options => options.map(o => o.value)")
    assert voices == info["voices"]
    formats = page.eval_on_selector_all("#format option", "options => options.map(o => o.value)")
    assert set(formats) == set(info["stream_formats"]) and formats[:2] == ["wav", "pcm"]  # streaming: no flac
    page.uncheck("#stream")
    formats = page.eval_on_selector_all("#format option", "options => options.map(o => o.value)")
    assert set(formats) == set(info["formats"]) and "flac" in formats
    page.check("#stream")
    assert page.is_enabled("#speak") and page.is_checked("#stream")


@pytest.mark.parametrize("format_name", ["wav", "pcm"])
def test_speak_streams_plays_and_offers_the_audio(page: Any, info: dict[str, Any], format_name: str) -> None:
    voice = info["voices"][-1]
    page.select_option("#voice", voice)
    page.select_option("#format", format_name)
    with page.expect_request("**/v1/tts") as request:
        state = _speak(page, "Hi there.")
    assert state == "done", page.text_content("#error")
    expected = {"text": "Hi there.", "voice": voice, "format": format_name, "stream": True, "speed": 1}
    assert request.value.post_data_json == expected
    assert request.value.headers["authorization"] == f"Bearer {API_KEY}"
    assert page.is_hidden("#error")

    received = int(page.get_attribute("#received", "data-bytes"))
    header = WAV_HEADER_BYTES if format_name == "wav" else 0
    samples = (received - header) // PCM_BYTES_PER_SAMPLE
    assert samples > 0
    assert re.fullmatch(r"\d+ ms", page.text_content("#ttfa"))
    assert re.match(r"\d+\.\d{3} \(", page.text_content("#rtf"))
    assert page.text_content("#duration") == f"{samples / info['sample_rate']:.2f} s"
    # Every sample went to the audio output, unless the browser has none (then the page says so).
    scheduled = int(page.get_attribute("#playback", "data-scheduled-samples"))
    assert scheduled == samples or page.text_content("#playback").startswith("unavailable")

    assert page.get_attribute("#download", "download") == f"speech.{format_name}"
    data = _download(page)
    assert len(data) == received
    if format_name == "wav":  # the page replaced the streamed header's unknown sizes with the real ones
        assert struct.unpack_from("<I", data, 4)[0] == len(data) - 8
        assert struct.unpack_from("<I", data, WAV_HEADER_BYTES - 4)[0] == len(data) - WAV_HEADER_BYTES
        audio, rate = sf.read(io.BytesIO(data), dtype="float32")
        assert rate == info["sample_rate"] and len(audio) == samples and np.isfinite(audio).all()
    _assert_waveform_drawn(page, samples)


def _assert_waveform_drawn(page: Any, samples: int) -> None:
    """The canvas shows every received sample across its whole width, and has ink on it."""
    assert int(page.get_attribute("#waveform", "data-drawn-samples")) == samples
    width = int(page.get_attribute("#waveform", "width"))
    assert abs(int(page.get_attribute("#waveform", "data-drawn-width")) - width) <= 1
    inked = page.evaluate(
        """() => {
            const canvas = document.getElementById('waveform');
            const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
            let count = 0;
            for (let i = 3; i < pixels.length; i += 4) if (pixels[i] > 0) count++;
            return count;
        }"""
    )
    assert inked > 0


def test_speak_without_streaming_at_another_speed(page: Any, info: dict[str, Any], tmp_path: Any) -> None:
    page.uncheck("#stream")
    page.fill("#speed", "1.5")
    with page.expect_request("**/v1/tts") as request:
        state = _speak(page, "Whole, then played.")
    assert state == "done", page.text_content("#error")
    body = request.value.post_data_json
    assert body["stream"] is False and body["speed"] == 1.5
    received = int(page.get_attribute("#received", "data-bytes"))
    _assert_waveform_drawn(page, (received - WAV_HEADER_BYTES) // PCM_BYTES_PER_SAMPLE)
    page.screenshot(path=str(tmp_path / "whole-response.png"), full_page=True)


def _registered_ids(page: Any) -> list[str]:
    return page.eval_on_selector_all(
        "#registered-voices li[data-voice-id]", "items => items.map(i => i.dataset.voiceId)"
    )


def _register(page: Any, transcript: str) -> str:
    """Press Register in the open voice dialog; the id of the voice it added."""
    before = set(_registered_ids(page))
    page.fill("#transcript", transcript)
    page.click("#register")
    page.wait_for_function(
        f"document.querySelectorAll('#registered-voices li[data-voice-id]').length > {len(before)}"
        " || !document.getElementById('voice-error').hidden",
        timeout=SYNTHESIS_WAIT_MS,
    )
    assert page.is_hidden("#voice-error"), page.text_content("#voice-error")
    [added] = set(_registered_ids(page)) - before
    return added


def test_register_a_voice_from_a_file_speak_with_it_and_delete_it(
    page: Any, client: httpx.Client, tmp_path: Any
) -> None:
    page.click("#open-voices")
    page.set_input_files("#voice-file", files=[{"name": "me.wav", "mimeType": "audio/wav", "buffer": _prompt_wav()}])
    voice_id = _register(page, "Hello from my recording.")
    assert voice_id in [voice["id"] for voice in client.get("/v1/voices").json()["registered_voices"]]
    assert page.input_value("#voice") == voice_id  # the new voice is picked
    page.screenshot(path=str(tmp_path / "voice-dialog.png"), full_page=True)
    page.click("#close-voices")

    page.select_option("#mode", "cross-lingual")
    with page.expect_request("**/v1/tts") as request:
        state = _speak(page, "Said in the cloned voice.")
    assert state == "done", page.text_content("#error")
    assert request.value.post_data_json["voice"] == voice_id and request.value.post_data_json["cross_lingual"] is True
    page.screenshot(path=str(tmp_path / "cloned-voice.png"), full_page=True)

    page.click("#open-voices")
    page.click(f"#registered-voices li[data-voice-id='{voice_id}'] button.delete-voice")
    page.wait_for_function(f"!document.querySelector(\"#registered-voices li[data-voice-id='{voice_id}']\")")
    assert voice_id not in [voice["id"] for voice in client.get("/v1/voices").json()["registered_voices"]]
    assert voice_id not in page.eval_on_selector_all("#voice option", "options => options.map(o => o.value)")


def test_register_a_voice_recorded_from_the_microphone(page: Any, client: httpx.Client) -> None:
    page.click("#open-voices")
    page.click("#record")
    page.wait_for_function("document.getElementById('recording-state').dataset.state === 'recording'")
    page.wait_for_timeout(2500)  # longer than the 1 s minimum prompt
    page.click("#stop-recording")
    page.wait_for_function("document.getElementById('recording-state').dataset.state !== 'recording'")
    assert page.get_attribute("#recording-state", "data-state") == "recorded", page.text_content("#voice-error")
    voice_id = _register(page, "A beep from the fake microphone.")
    record = next(voice for voice in client.get("/v1/voices").json()["registered_voices"] if voice["id"] == voice_id)
    assert record["duration_s"] >= 1.0
    assert client.delete(f"/v1/voices/{voice_id}").status_code == 200


def test_instruct_mode_is_off_with_its_reason_on_a_model_without_instructions(page: Any, info: dict[str, Any]) -> None:
    assert info["instructions"] == "none"  # the tiny v1 model
    option = "#mode option[value=instruct]"
    assert page.eval_on_selector(option, "o => o.disabled") is True
    assert "follows no instructions" in page.text_content(option)


@pytest.mark.parametrize("format_name", ["mp3", "flac"])
def test_an_encoded_format_plays_once_received(page: Any, format_name: str) -> None:
    page.uncheck("#stream")
    page.select_option("#format", format_name)
    assert _speak(page, "Encoded, then decoded by the browser.") == "done", page.text_content("#error")
    samples = int(page.get_attribute("#waveform", "data-drawn-samples"))
    assert samples > 0 and page.text_content("#duration").endswith(" s")
    _assert_waveform_drawn(page, samples)
    assert page.get_attribute("#download", "download") == f"speech.{format_name}"


def test_a_first_visit_to_a_server_with_keys_asks_for_the_key(
    first_visit_page: Any, info: dict[str, Any], tmp_path: Any
) -> None:
    page = first_visit_page
    assert page.get_attribute("#status", "data-state") == "error"
    assert "missing or invalid API key" in page.text_content("#error")
    page.screenshot(path=str(tmp_path / "needs-a-key.png"), full_page=True)
    page.fill("#api-key", API_KEY)
    page.click("#save-key")
    page.wait_for_function("document.getElementById('status').dataset.state === 'ready'")
    assert page.evaluate(f"localStorage.getItem({KEY_STORAGE!r})") == API_KEY
    with page.expect_request("**/v1/tts") as request:
        assert _speak(page, "Now with the key.") == "done", page.text_content("#error")
    assert request.value.headers["authorization"] == f"Bearer {API_KEY}"


def test_api_error_is_shown(page: Any) -> None:
    assert _speak(page, "   ") == "error"
    assert page.is_visible("#error")
    assert page.text_content("#error") == "the input text is empty"
    assert page.is_hidden("#download")
    assert page.get_attribute("#received", "data-bytes") == "0"


def test_speak_as_i_type_speaks_each_sentence_over_the_websocket_as_it_is_typed(
    page: Any, info: dict[str, Any]
) -> None:
    sent: list[str] = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(payload)))
    page.fill("#text", "")
    page.check("#speak-as-i-type")
    assert page.is_visible("#typing-hint")
    page.type("#text", "Hello there. How are", delay=20)
    # The first sentence is spoken while the text goes on: its audio comes before the end is sent.
    page.wait_for_function("Number(document.getElementById('received').dataset.bytes) > 0", timeout=SYNTHESIS_WAIT_MS)
    assert page.get_attribute("#status", "data-state") == "streaming"
    assert all(json.loads(frame)["type"] != "end" for frame in sent)
    page.type("#text", " you?", delay=20)
    page.click("#speak")  # speaks the rest and ends the stream
    page.wait_for_function(
        "['done', 'error'].includes(document.getElementById('status').dataset.state)", timeout=SYNTHESIS_WAIT_MS
    )
    assert page.get_attribute("#status", "data-state") == "done", page.text_content("#error")

    messages = [json.loads(frame) for frame in sent]
    start = {"type": "start", "model": info["model"], "voice": page.input_value("#voice"), "response_format": "pcm"}
    assert messages[0] == start | {"speed": 1}
    assert "".join(message["text"] for message in messages if message["type"] == "text") == "Hello there. How are you?"
    assert messages[-1] == {"type": "end"}
    samples = int(page.get_attribute("#received", "data-bytes")) // PCM_BYTES_PER_SAMPLE
    assert page.text_content("#duration") == f"{samples / 24000:.2f} s"
    scheduled = int(page.get_attribute("#playback", "data-scheduled-samples"))
    assert scheduled == samples or page.text_content("#playback").startswith("unavailable")
    _assert_waveform_drawn(page, samples)
    assert page.get_attribute("#download", "download") == "speech.pcm"


# The text stream WebSocket, through the example client and by hand.
STREAM_PATH = "/v1/audio/speech/stream"
STREAM_WAIT_S = 120.0
# Four words a second: the first sentence is whole at the third word, the text's end goes out after ~4 s.
PACED_TEXT = "Hello there. This text is typed a few words at a time, as a language model would write it."
LONG_SENTENCE = " ".join(["A long sentence that keeps the decoder busy for a while"] * 4) + "."


def _example_client() -> Any:
    path = Path(__file__).parents[2] / "examples" / "stream_text_ws.py"
    spec = importlib.util.spec_from_file_location("stream_text_ws", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _ws_url(base_url: str) -> str:
    return base_url.replace("http://", "ws://", 1) + STREAM_PATH


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _off_loop(call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)` in a thread of its own: Playwright's sync API runs an event loop in this one, in which neither
    `asyncio.run` nor a Serve handle's blocking `result()` may be called."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(call, *args).result()


def _run(coro: Any) -> Any:
    return _off_loop(asyncio.run, asyncio.wait_for(coro, STREAM_WAIT_S))


def _decoder_stats() -> dict[str, Any]:
    return _off_loop(lambda: serve.get_deployment_handle("Decoder", APP).batch_stats.remote().result())


def test_the_example_client_hears_the_first_sentence_before_the_text_ends(base_url: str) -> None:
    client = _example_client()
    out = io.BytesIO()
    start = {"model": "tts-1", "voice": "alloy", "response_format": "wav"}  # OpenAI's names, as on /v1/audio/speech
    deltas = client.paced(client.words_of(PACED_TEXT), 4.0)
    result = _run(client.stream_text(_ws_url(base_url), deltas, out, start, API_KEY))
    assert result.first_audio_s is not None and result.first_audio_s < result.end_sent_s, result
    data = out.getvalue()
    # One wav stream across every sentence: one header, then 16-bit samples at OpenAI's 24 kHz.
    assert data[:4] == b"RIFF" and data.count(b"RIFF") == 1 and len(data) == result.audio_bytes
    assert struct.unpack_from("<I", data, 24)[0] == 24000 and (len(data) - WAV_HEADER_BYTES) % PCM_BYTES_PER_SAMPLE == 0
    usage = result.usage
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_the_example_client_reports_an_error_event(base_url: str) -> None:
    client = _example_client()
    start = {"model": "tts-1", "voice": "alloy", "response_format": "flac"}  # flac cannot stream
    with pytest.raises(client.StreamError) as failed:
        _run(client.stream_text(_ws_url(base_url), client.words_of("Hi."), io.BytesIO(), start, API_KEY))
    assert failed.value.error["type"] == "invalid_request_error" and "flac" in failed.value.error["message"]


async def _error_after(base_url: str, messages: list[str]) -> tuple[dict[str, Any], int | None]:
    """The event the server sends after `messages`, and the close code that follows it."""
    async with websockets.connect(_ws_url(base_url), additional_headers=_auth()) as ws:
        for message in messages:
            await ws.send(message)
        event = json.loads(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
        return event, ws.close_code


START = json.dumps({"type": "start", "model": "tiny", "voice": "dummy_female", "response_format": "pcm"})


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        (["not json"], "malformed JSON message"),
        ([json.dumps({"type": "text", "text": "Hi."})], "the first message must be"),
        ([json.dumps({"type": "shout"})], "does not match any of the expected tags"),
        ([json.dumps({"type": "start", "model": "gpt-5", "voice": "alloy"})], "unknown model 'gpt-5'"),
        ([json.dumps({"type": "start", "model": "tiny", "voice": "nobody"})], "nobody"),
        ([START, json.dumps({"type": "text", "text": "x" * 5000})], "the limit is 4096"),
        ([START, json.dumps({"type": "end"})], "the input text is empty"),
        ([START, START], "a second start message"),
    ],
)
def test_a_bad_message_gets_an_error_event_and_a_clean_close(base_url: str, messages: list[str], needle: str) -> None:
    event, code = _run(_error_after(base_url, messages))
    assert event["type"] == "error" and needle in event["error"]["message"], event
    assert event["error"]["type"] == "invalid_request_error" and event["error"]["code"]
    assert code == 1008  # policy violation: the client's error


def test_a_stream_without_a_valid_key_is_refused_and_a_browser_may_offer_its_key_as_a_subprotocol(
    base_url: str,
) -> None:
    async def refused(headers: dict[str, str] | None) -> tuple[int, dict[str, Any]]:
        with pytest.raises(websockets.InvalidStatus) as denied:
            async with websockets.connect(_ws_url(base_url), additional_headers=headers):
                pass
        response = denied.value.response
        return response.status_code, json.loads(response.body)["error"]

    for headers in (None, {"Authorization": "Bearer wrong-key"}):
        status, error = _run(refused(headers))
        assert status == 401 and error["code"] == "invalid_api_key"

    async def with_protocol_key() -> tuple[str | None, dict[str, Any]]:
        key = base64.urlsafe_b64encode(API_KEY.encode()).decode().rstrip("=")
        protocols = [WEBSOCKET_PROTOCOL, WEBSOCKET_KEY_PROTOCOL_PREFIX + key]
        async with websockets.connect(_ws_url(base_url), subprotocols=protocols) as ws:
            await ws.send(json.dumps({"type": "end"}))
            return ws.subprotocol, json.loads(await ws.recv())

    protocol, event = _run(with_protocol_key())
    assert protocol == WEBSOCKET_PROTOCOL and "the first message must be" in event["error"]["message"]


def test_a_client_that_leaves_mid_stream_frees_its_decoder_slot(base_url: str) -> None:
    before = _decoder_stats()

    async def leave_after_first_audio() -> None:
        async with websockets.connect(_ws_url(base_url), additional_headers=_auth()) as ws:
            await ws.send(START)
            await ws.send(json.dumps({"type": "text", "text": LONG_SENTENCE}))
            await ws.send(json.dumps({"type": "flush"}))
            assert isinstance(await ws.recv(), bytes)  # audio is coming: the decode is under way
        # leaving the block closes the connection mid-stream

    _run(leave_after_first_audio())
    wait_until(lambda: _decoder_stats()["live"] == 0, 60, "the left stream to leave the decoder loop")
    assert _decoder_stats()["cancelled"] == before["cancelled"] + 1  # cancelled, not decoded to its end
    client = _example_client()
    start = {"model": "tiny", "voice": "dummy_male", "response_format": "pcm"}
    result = _run(client.stream_text(_ws_url(base_url), client.words_of("Next, please."), io.BytesIO(), start, API_KEY))
    assert result.audio_bytes > 0 and result.usage["output_tokens"] > 0
