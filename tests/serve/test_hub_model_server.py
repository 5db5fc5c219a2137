"""The article's reader on one small GPU with the newest model, as far as a machine without a GPU can run it: a
CosyVoice3 model named by its Hugging Face id, served offline from a Hugging Face cache laid out on disk (the v3 kit's
tiny model, without built-in speakers as Fun-CosyVoice3-0.5B, with an `llm.rl.pt`), placed by the plan for an 8 GB
card (Ray given one logical GPU: the replicas schedule on it and, without CUDA, run on CPU). It answers under the
id's name with the RL LLM, and OpenAI's `alloy` from its first request in the default voice."""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import ray
import soundfile as sf
from ray import serve

from engine.nn.precision import CpuCapabilities
from engine.voices.default_voice import DEFAULT_VOICE_ID, DEFAULT_VOICE_NAME
from serve_app.cli_run import follow_plan
from serve_app.inventory import Gpu, Inventory
from serve_app.request_args import OPENAI_VOICE_NAMES
from tests.engine.conftest import REPO_ID, V3_KIT_MODEL, hugging_face_cache
from tests.serve.conftest import on_cpus, running_app

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

ROOT = Path(__file__).resolve().parents[2]
CLONING_MODELS = ROOT / "engine" / "loading" / "presets" / "voice_models" / "cosyvoice3-tiny"
EIGHT_GB_CARD = Gpu("a stand-in 8 GB card", 8188 * 2**20, True)


def v3_model_without_speakers(folder: Path) -> Path:
    """The v3 kit's model dir as Fun-CosyVoice3-0.5B-2512 is laid out: no spk2info.pt, an llm.rl.pt, the cloning
    models (the tiny ones the cosyvoice3-tiny preset ships, over the same 96-token speech vocabulary)."""
    shutil.copytree(V3_KIT_MODEL, folder, ignore=shutil.ignore_patterns("spk2info.pt"))
    shutil.copy(folder / "llm.pt", folder / "llm.rl.pt")
    for onnx in CLONING_MODELS.iterdir():
        shutil.copy(onnx, folder / onnx.name)
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("one_gpu")
    home = root / "hf"
    hugging_face_cache(home, REPO_ID, v3_model_without_speakers(root / "model"))
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as patch:
        # The replicas' processes read these at start (Ray's workers inherit the environment); this process's
        # huggingface_hub read them at its import.
        patch.setenv("HF_HOME", str(home))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        args = {"model": REPO_ID, "voices_dir": str(root / "voices")}
        machine = Inventory(gpus=(EIGHT_GB_CARD,), cpus=2, cpu=CpuCapabilities(frozenset()))
        planned, deployments = follow_plan(args, on_cpus(Encoder=0.25), "auto", machine)
        with running_app(planned, "one_gpu", deployments=deployments, num_gpus=1) as url:
            yield url, planned


def test_the_plan_places_the_decoders_on_the_gpu(served: tuple[str, dict[str, Any]]) -> None:
    _, planned = served
    fraction = planned["decoder"]["num_gpus"]
    rules = planned["decoder"]["autoscaling"]["rules"]
    # the tiny model's replicas are small: the card holds many, the 2 CPUs three beside the ingress and the encoder
    assert 0 < fraction < 1 and (rules["min_replicas"], rules["max_replicas"]) == (1, 3)
    running = serve.status().applications["one_gpu"].deployments["Decoder"].replica_states.get("RUNNING", 0)
    gpu_in_use = ray.cluster_resources()["GPU"] - ray.available_resources().get("GPU", 0)
    assert running >= 1 and gpu_in_use == pytest.approx(running * fraction)  # each replica holds its fraction


def test_the_model_answers_under_its_ids_name_with_the_rl_llm(served: tuple[str, dict[str, Any]]) -> None:
    url, _ = served
    models = httpx.get(f"{url}/v1/models", timeout=60).json()["data"]
    assert models[0]["id"] == "Fun-CosyVoice3-0.5B-2512"
    assert {model["llm_checkpoint"] for model in models} == {"llm.rl.pt"}


def test_alloy_speaks_in_the_default_voice_from_the_first_request(served: tuple[str, dict[str, Any]]) -> None:
    url, _ = served
    speech = {"model": "tts-1", "input": "Hello.", "voice": "alloy", "response_format": "wav"}
    response = httpx.post(f"{url}/v1/audio/speech", json=speech, timeout=300)
    assert response.status_code == 200, response.text
    audio, rate = sf.read(io.BytesIO(response.content))
    assert rate == 24000 and len(audio) > 0
    # The default voice has a stored prompt: CosyVoice3 follows instructions in it (instruct2), none ignored.
    instructed = httpx.post(f"{url}/v1/audio/speech", json={**speech, "instructions": "Speak slowly."}, timeout=300)
    assert instructed.status_code == 200 and "x-instructions" not in instructed.headers, instructed.text
    listing = httpx.get(f"{url}/v1/voices", timeout=60).json()
    assert listing["voices"] == []  # no built-in speakers
    assert listing["openai_voices"] == dict.fromkeys(OPENAI_VOICE_NAMES, DEFAULT_VOICE_ID)
    (default,) = [voice for voice in listing["registered_voices"] if voice["id"] == DEFAULT_VOICE_ID]
    assert default["name"] == DEFAULT_VOICE_NAME and default["transcript"] == "希望你以后能够做的比我还好呦。"


def test_the_default_voice_comes_after_a_voice_registered_for_a_name(served: tuple[str, dict[str, Any]]) -> None:
    """echo, which nothing else takes, speaks the default voice; nova, once a voice is registered with that OpenAI
    name, speaks that voice instead (the same seed, another prompt: other audio)."""
    url, _ = served

    def speak(voice: str) -> bytes:
        body = {"text": "Hello there.", "voice": voice, "format": "pcm", "seed": 3}
        response = httpx.post(f"{url}/v1/tts", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return response.content

    assert speak("echo") == speak(DEFAULT_VOICE_ID) == speak("nova")
    unnamed = httpx.post(f"{url}/v1/tts", json={"text": "Hello there.", "format": "pcm", "seed": 3}, timeout=300)
    assert unnamed.content == speak(DEFAULT_VOICE_ID)  # no voice given (`cosyvoice-serve say`): the default one
    rate = 16000
    tone = (0.3 * np.sin(2 * np.pi * 170 * np.arange(2 * rate) / rate)).astype(np.float32)
    recording = io.BytesIO()
    sf.write(recording, tone, rate, format="WAV")
    form = {"transcript": "Hello there.", "openai_name": "nova"}
    registered = httpx.post(
        f"{url}/v1/voices", data=form, files={"file": ("me.wav", recording.getvalue())}, timeout=300
    )
    assert registered.status_code == 201, registered.text
    assert speak("nova") == speak(registered.json()["id"]) != speak(DEFAULT_VOICE_ID)
    assert speak("echo") == speak(DEFAULT_VOICE_ID)
