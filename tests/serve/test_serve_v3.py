"""CosyVoice3 served: the app on `cosyvoice3-tiny` as `cosyvoice-serve run --model cosyvoice3-tiny` builds it (the
preset's cloning models, a voices dir), whole requests, a registered voice in every mode, OpenAI `instructions` with
a registered voice, `cosyvoice-serve say`, and a voice of another family refused."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
from ray import serve

from serve_app.cli import main as cli_main
from serve_app.cli import parser
from serve_app.cli_run import with_default_voices_dir
from serve_app.ingress import build_app_with_overrides
from tests.serve.conftest import on_cpus, running_app, text_stream_exchange

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

SMALL = {"decoder": {"num_cpus": 0.3}}
SMALL_DEPLOYMENTS = on_cpus(TTSIngress=0.1, Encoder=0.1)
SHORT = {"sampling": {"max_token_text_ratio": 3.0}}  # dummy weights speak until max_len


def wav_bytes(seconds: float = 2.0, sample_rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 190 * t)).astype(np.float32), sample_rate, format="WAV")
    return buffer.getvalue()


def test_run_takes_a_preset_name_and_gives_it_a_voices_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = parser().parse_args(["run", "--model", "cosyvoice3-tiny"])
    assert options.model == "cosyvoice3-tiny"
    assert parser().parse_args(["run", "--model-dir", "/models/x"]).model == "/models/x"  # the older spelling
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    args = with_default_voices_dir({"model": options.model})  # the preset ships its cloning models
    assert args["voices_dir"] == str(tmp_path / "cosyvoice-serve" / "voices" / "cosyvoice3-tiny")


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`cosyvoice3-tiny` at "/", and `cosyvoice2-tiny` at "/v2" sharing its voices dir."""
    voices = tmp_path_factory.mktemp("voices")
    with running_app(
        {"model": "cosyvoice3-tiny", **SMALL, "voices_dir": str(voices)}, "v3-test", deployments=SMALL_DEPLOYMENTS
    ) as url:
        v2 = build_app_with_overrides(
            {"model": "cosyvoice2-tiny", **SMALL, "voices_dir": str(voices)}, SMALL_DEPLOYMENTS
        )
        serve.run(v2, name="v2", route_prefix="/v2")
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=300) as http:
        yield http


def register(client: httpx.Client, prefix: str = "") -> str:
    response = client.post(
        f"{prefix}/v1/voices", files={"file": ("me.wav", wav_bytes(), "audio/wav")}, data={"transcript": "Hi there."}
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]


def speech(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    audio, rate = sf.read(io.BytesIO(response.content), dtype="float32")
    assert rate == 24000 and len(audio) > 0 and np.isfinite(audio).all()
    return audio


def test_the_model_reports_cloning_and_instructions_in_registered_voices(client: httpx.Client) -> None:
    info = client.get("/v1/voices").json()
    assert info["sample_rate"] == 24000 and info["voice_cloning"] is True
    assert info["instructions"] == "registered_voices" and info["voices"] == ["dummy_female", "dummy_male"]


def test_a_whole_request_with_a_built_in_speaker(client: httpx.Client) -> None:
    speech(client.post("/v1/tts", json={"text": "Hello from CosyVoice3.", "format": "wav", **SHORT}))


def test_a_registered_voice_speaks_in_every_mode_and_is_deleted(client: httpx.Client) -> None:
    voice = register(client)
    assert voice in [record["id"] for record in client.get("/v1/voices").json()["registered_voices"]]
    for mode in ({}, {"cross_lingual": True}, {"instruct_text": "Speak happily."}):
        body = {"text": "In my voice.", "voice": voice, "format": "wav", **SHORT, **mode}
        speech(client.post("/v1/tts", json=body))
    assert client.delete(f"/v1/voices/{voice}").status_code == 200
    assert client.post("/v1/tts", json={"text": "Hi.", "voice": voice, **SHORT}).status_code == 404


def test_openai_instructions_with_a_registered_voice(client: httpx.Client) -> None:
    """Followed in a registered voice; in a built-in speaker (no stored prompt for instruct2) ignored, as tts-1 does."""
    voice = register(client)
    body: dict[str, Any] = {"model": "tts-1", "input": "Hi.", "voice": voice, "instructions": "Speak happily."}
    followed = client.post("/v1/audio/speech", json={**body, "response_format": "wav"})
    speech(followed)
    sse = client.post("/v1/audio/speech", json={**body, "response_format": "wav", "stream_format": "sse"})
    assert sse.status_code == 200 and "speech.audio.done" in sse.text, sse.text
    assert "x-instructions" not in followed.headers and "x-instructions" not in sse.headers
    builtin = client.post("/v1/audio/speech", json={**body, "voice": "alloy", "response_format": "wav"})
    speech(builtin)
    assert builtin.headers["x-instructions"] == "ignored"
    assert "registered (cloned) voice only" in builtin.headers["x-instructions-reason"]


def test_a_lone_surrogate_in_any_text_is_a_400_and_the_neighbour_hears_its_audio(
    base_url: str, client: httpx.Client
) -> None:
    """JSON's "\\ud800" escape alone is half a UTF-16 pair: CosyVoice3's Qwen tokenizer raised a TypeError on it
    (500 on both HTTP APIs, 1011 on the text stream); now the field is named in a 400 before anything runs."""
    voice = register(client)
    neighbour = {"text": "In my voice.", "voice": voice, "format": "wav", "seed": 5, **SHORT}
    neighbour["instruct_text"] = "Speak happily."
    quiet = client.post("/v1/tts", json=neighbour)
    assert quiet.status_code == 200, quiet.text
    # Raw JSON with the escapes, as a client sends them (a lone surrogate itself cannot be encoded in UTF-8).
    http_attacks = [
        ("/v1/audio/speech", f'{{"model": "tts-1", "input": "Hi.", "voice": "{voice}", "instructions": "x\\ud800"}}'),
        ("/v1/audio/speech", f'{{"model": "tts-1", "input": "Hi \\udfff.", "voice": "{voice}"}}'),
        ("/v1/tts", f'{{"text": "Hi.", "voice": "{voice}", "instruct_text": "\\udc00 Speak happily."}}'),
    ]
    start = f'{{"type": "start", "model": "tts-1", "voice": "{voice}", "response_format": "pcm"'
    stream_attacks = [
        [start + ', "instructions": "Speak \\ud800 happily."}'],
        [start + "}", '{"type": "text", "text": "Hello \\udc00 there."}', {"type": "end"}],
    ]

    def post(path_raw: tuple[str, str]) -> httpx.Response:
        path, raw = path_raw
        return client.post(path, content=raw.encode(), headers={"content-type": "application/json"})

    with ThreadPoolExecutor(len(http_attacks) + 1) as pool:
        beside = pool.submit(client.post, "/v1/tts", json=neighbour)
        refused = list(pool.map(post, http_attacks))
        streams = [asyncio.run(text_stream_exchange(base_url, messages)) for messages in stream_attacks]
        assert beside.result().content == quiet.content  # seeded: the same audio, byte for byte
    for response in refused:
        assert response.status_code == 400 and "lone surrogate" in response.json()["error"]["message"], response.text
    for events, audio, code in streams:
        assert code == 1008 and not audio and "lone surrogate" in events[-1]["error"]["message"], events


def test_cosyvoice_serve_say(base_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    assert cli_main(["say", "Said through the CLI.", "-o", str(out), "--url", base_url, "--seed", "2"]) == 0
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and len(audio) > 0 and np.isfinite(audio).all()


def test_a_voice_registered_by_a_cosyvoice2_server_is_refused_by_name(client: httpx.Client) -> None:
    voice = register(client, "/v2")  # the same voices dir: the v3 server finds the v2 voice
    response = client.post("/v1/tts", json={"text": "Hi.", "voice": voice, **SHORT})
    assert response.status_code == 400, response.text
    assert "prepared for CosyVoice2 models; this model is CosyVoice3" in response.json()["error"]["message"]
    speech(client.post("/v2/v1/tts", json={"text": "Hi.", "voice": voice, "format": "wav", **SHORT}))
