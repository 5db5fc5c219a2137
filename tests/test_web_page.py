"""The try-it page at GET /: served with its assets, and driven in headless Chromium against a real Serve app.

The browser tests use Playwright with the system Chromium (Debian's `chromium`; `$COSYVOICE_BROWSER` points at
another binary) and skip, saying why, where Playwright or the browser is missing. They check that the audio
data arrives and is scheduled for playback, not that it is heard: a headless machine may have no sound device.
"""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("ray")
from serve_testing import running_app

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
]
WAIT_MS = 30_000
SYNTHESIS_WAIT_MS = 180_000  # a 2-CPU machine decodes the tiny model a few times slower than real time
WAV_HEADER_BYTES = 44  # serve_app.audio.streaming_wav_header
PCM_BYTES_PER_SAMPLE = 2


def _browser_path() -> str | None:
    explicit = os.environ.get("COSYVOICE_BROWSER")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return next((path for name in BROWSER_NAMES if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    args = {"model": "tiny", "ingress": {"num_cpus": 0.25}, "encoder": {"num_cpus": 0.25}, "decoder": {"num_cpus": 0.5}}
    with running_app(args, "tts-web-test") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as http:
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


@pytest.fixture
def page(browser: Any, base_url: str) -> Iterator[Any]:
    context = browser.new_context()
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


def test_page_and_assets_are_served(client: httpx.Client) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="speak"' in page.text and 'src="static/app.js"' in page.text
    script = client.get("/static/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "v1/tts" in script.text
    style = client.get("/static/style.css")
    assert style.status_code == 200 and style.headers["content-type"].startswith("text/css")
    missing = client.get("/static/no-such-file.js")
    assert missing.status_code == 404 and missing.json()["error"]["message"]


def test_pickers_are_filled_from_the_api(page: Any, info: dict[str, Any]) -> None:
    assert page.get_attribute("#status", "data-state") == "ready"
    voices = page.eval_on_selector_all("#voice option", "options => options.map(o => o.value)")
    assert voices == info["voices"]
    formats = page.eval_on_selector_all("#format option", "options => options.map(o => o.value)")
    assert formats == [name for name in ("wav", "pcm") if name in info["formats"]]
    assert page.is_enabled("#speak")


@pytest.mark.parametrize("format_name", ["wav", "pcm"])
def test_speak_streams_plays_and_offers_the_audio(page: Any, info: dict[str, Any], format_name: str) -> None:
    voice = info["voices"][-1]
    page.select_option("#voice", voice)
    page.select_option("#format", format_name)
    with page.expect_request("**/v1/tts") as request:
        state = _speak(page, "Hi there.")
    assert state == "done", page.text_content("#error")
    assert request.value.post_data_json == {"text": "Hi there.", "voice": voice, "format": format_name, "stream": True}
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


def test_api_error_is_shown(page: Any) -> None:
    assert _speak(page, "   ") == "error"
    assert page.is_visible("#error")
    assert page.text_content("#error") == "the input text is empty"
    assert page.is_hidden("#download")
    assert page.get_attribute("#received", "data-bytes") == "0"
