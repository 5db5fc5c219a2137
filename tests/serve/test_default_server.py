"""`cosyvoice-serve run` with no flags, from a fresh clone: it registers, uses, lists and deletes a cloned voice
with nothing downloaded or generated (the tiny preset ships its cloning models), keeping voices per user.

The clone is of the committed HEAD, so this checks what a new user gets; it skips outside a git checkout.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.serve.conftest import cli_server

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

REPO = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 60


def _prompt_wav(seconds: float = 2.0, sample_rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), sample_rate, format="WAV")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: there is no commit to clone")
    clone = tmp_path_factory.mktemp("clone") / "cosyvoice-serve"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    return clone


@pytest.fixture(scope="module")
def server(fresh_clone: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(URL, home dir) of `cosyvoice-serve run` started in the clone, for a user with an empty home."""
    home = tmp_path_factory.mktemp("home")
    with cli_server(fresh_clone, home) as (process, url):
        yield url, home
        process.send_signal(signal.SIGINT)  # the CLI shuts Serve and Ray down on Ctrl-C (killed if still running)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_TIMEOUT_S)


def test_the_clone_ships_the_cloning_models(fresh_clone: Path) -> None:
    shipped = ("tiny/speech_tokenizer_v1.onnx", "cosyvoice2-tiny/speech_tokenizer_v2.onnx")
    shipped += ("cosyvoice3-tiny/speech_tokenizer_v3.onnx", "cosyvoice3-tiny/campplus.onnx", "tiny/campplus.onnx")
    for name in shipped:
        assert (fresh_clone / "engine" / "loading" / "presets" / "voice_models" / name).is_file(), name


def test_register_use_list_and_delete_a_voice(server: tuple[str, Path]) -> None:
    url, home = server
    with httpx.Client(base_url=url, timeout=300) as client:
        assert client.get("/v1/voices").json()["voice_cloning"] is True
        created = client.post(
            "/v1/voices", files={"file": ("me.wav", _prompt_wav(), "audio/wav")}, data={"transcript": "Hello there."}
        )
        assert created.status_code == 201, created.text
        voice_id = created.json()["id"]
        assert (home / ".local" / "share" / "cosyvoice-serve" / "voices" / "tiny" / f"{voice_id}.npz").is_file()
        listed = [voice["id"] for voice in client.get("/v1/voices").json()["registered_voices"]]
        assert listed == [voice_id]

        body = {"text": "In my voice.", "voice": voice_id, "seed": 1, "sampling": {"max_token_text_ratio": 3.0}}
        spoken = client.post("/v1/tts", json=body)
        assert spoken.status_code == 200, spoken.text
        audio, _ = sf.read(io.BytesIO(spoken.content), dtype="float32")
        assert len(audio) > 0 and np.isfinite(audio).all()

        assert client.delete(f"/v1/voices/{voice_id}").json() == {"id": voice_id, "object": "voice", "deleted": True}
        assert client.get("/v1/voices").json()["registered_voices"] == []
        assert client.post("/v1/tts", json=body).status_code == 404
