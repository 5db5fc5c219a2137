"""Voices provisioned at deploy (app args `voices`): the args, the OpenAI voice table of a model with and without
built-in speakers, and a real app on `cosyvoice3-tiny` with two encoder replicas that answers `voice="alloy"` from
its first request, shows the voice in /v1/voices, and keeps one voice across replicas and redeploys."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
from pydantic import ValidationError
from ray import serve

from engine.errors import UnknownVoiceError
from engine.voices.registry import is_voice_id, provisioned_voice_id
from serve_app.args import AppArgs
from serve_app.ingress import build_app_with_overrides
from serve_app.voice_names import mapped_voice, openai_voice_table
from tests.serve.conftest import on_cpus, running_app

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

NARRATOR = provisioned_voice_id("narrator")


def wav_file(path: Path, seconds: float = 2.0, sample_rate: int = 16000) -> Path:
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    sf.write(path, (0.3 * np.sin(2 * np.pi * 170 * t)).astype(np.float32), sample_rate, format="WAV")
    return path


def voice_args(file: str, **extra: Any) -> dict[str, Any]:
    return {"file": file, "transcript": "Hello there.", "id": "narrator", "openai_name": "alloy", **extra}


# --- args and the OpenAI table, no Ray -------------------------------------------------------------------


def test_provisioned_voice_ids() -> None:
    assert is_voice_id(NARRATOR) and NARRATOR == provisioned_voice_id("narrator") != provisioned_voice_id("other")
    assert provisioned_voice_id("voice_0123456789ab") == "voice_0123456789ab"  # already an id: kept


def test_the_voices_args(tmp_path: Path) -> None:
    args = AppArgs.model_validate(
        {"model": "cosyvoice3-tiny", "voices_dir": str(tmp_path), "voices": [voice_args("a.wav")]}
    )
    assert args.voices[0].voice_id == NARRATOR
    assert args.openai_voices["alloy"] == NARRATOR and args.openai_voices["echo"] == "dummy_male"  # the rest kept
    refused = {
        "without voices_dir": {"model": "cosyvoice3-tiny", "voices": [voice_args("a.wav")]},
        "the same id twice": {
            "voices_dir": str(tmp_path),
            "voices": [voice_args("a.wav"), voice_args("b.wav", openai_name="nova")],
        },
        "the same openai name twice": {
            "voices_dir": str(tmp_path),
            "voices": [voice_args("a.wav"), voice_args("b.wav", id="other")],
        },
        "a path with ..": {"voices_dir": str(tmp_path), "voices": [voice_args("../a.wav")]},
        "an id with a slash": {"voices_dir": str(tmp_path), "voices": [voice_args("a.wav", id="a/b")]},
    }
    for case, app_args in refused.items():
        with pytest.raises(ValidationError):
            AppArgs.model_validate({"model": "cosyvoice3-tiny", **app_args})
            pytest.fail(f"accepted: {case}")


def test_a_model_without_built_in_speakers_maps_openai_names_to_registered_voices_only() -> None:
    table = {"alloy": NARRATOR, "echo": "dummy_male", "nova": "dummy_female"}
    assert openai_voice_table(table, []) == {"alloy": NARRATOR}
    assert openai_voice_table(table, ["dummy_male", "dummy_female"]) == table
    assert mapped_voice("alloy", table, []) == NARRATOR
    with pytest.raises(UnknownVoiceError, match=r"no built-in speakers.*app args voices"):
        mapped_voice("echo", table, [])
    assert mapped_voice("echo", table, ["dummy_male"]) == "dummy_male"


# --- a real app ---------------------------------------------------------------------------------------------

SMALL = {"decoder": {"num_cpus": 0.3}}
SHORT = {"sampling": {"max_token_text_ratio": 3.0}}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any], Path]]:
    root = tmp_path_factory.mktemp("provisioned")
    voices_dir = root / "voices"
    args = {
        "model": "cosyvoice3-tiny",
        **SMALL,
        "voices_dir": str(voices_dir),
        "voices": [voice_args(str(wav_file(root / "narrator.wav")), name="The narrator")],
    }
    # two encoder replicas: both provision it at start, one voice
    deployments = [
        *on_cpus(TTSIngress=0.1),
        {"name": "Encoder", "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.1}},
    ]
    with running_app(args, "provisioned", deployments=deployments) as url:
        yield url, args, voices_dir


def test_alloy_speaks_from_the_first_request(deployed: tuple[str, dict[str, Any], Path]) -> None:
    url, _, _ = deployed
    with httpx.Client(base_url=url, timeout=300) as client:
        speech = {"model": "tts-1", "input": "Hello.", "voice": "alloy", "response_format": "wav"}
        first = client.post("/v1/audio/speech", json=speech)
        assert first.status_code == 200, first.text
        audio, rate = sf.read(io.BytesIO(first.content), dtype="float32")
        assert rate == 24000 and len(audio) > 0 and np.isfinite(audio).all()
        # A registered voice: CosyVoice3 follows instructions in it.
        instructed = client.post("/v1/audio/speech", json={**speech, "instructions": "Speak slowly."})
        assert instructed.status_code == 200, instructed.text
        listing = client.get("/v1/voices").json()
    assert listing["openai_voices"]["alloy"] == NARRATOR
    (record,) = [record for record in listing["registered_voices"] if record["id"] == NARRATOR]
    assert record["name"] == "The narrator" and record["transcript"] == "Hello there." and record["shared"] is True


def test_one_voice_across_replicas_and_redeploys(deployed: tuple[str, dict[str, Any], Path]) -> None:
    url, args, voices_dir = deployed
    assert sorted(path.name for path in voices_dir.iterdir() if path.name != ".lock") == [
        f"{NARRATOR}.json",
        f"{NARRATOR}.npz",
    ]
    before = (voices_dir / f"{NARRATOR}.json").read_text()
    # A redeploy with new encoder replicas (another replica count) finds the voice and keeps it as it was.
    one_encoder = on_cpus(TTSIngress=0.1, Encoder=0.1)
    serve.run(build_app_with_overrides(args, one_encoder), name="provisioned", route_prefix="/")
    with httpx.Client(base_url=url, timeout=300) as client:
        response = client.post("/v1/tts", json={"text": "Again.", "voice": "alloy", "format": "wav", **SHORT})
        assert response.status_code == 200, response.text
    assert (voices_dir / f"{NARRATOR}.json").read_text() == before
