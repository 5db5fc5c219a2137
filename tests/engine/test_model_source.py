"""Model sources (`engine.loading.model_source`): hub ids told from paths and presets, the served name, a Hugging Face
id served from a cache laid out on disk (offline, and with the hub unreachable), refused in one line naming the id,
the cache and the command to fetch it by hand; and the LLM checkpoint `auto` picks (the RL-tuned `llm.rl.pt` where a
model has it), which `load_model` really loads. Nothing here reaches the internet: the hub is a closed local port
or HF_HUB_OFFLINE."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.errors import CheckpointError
from engine.loading.loader import load_model
from engine.loading.model_source import (
    HubModel,
    ModelNotAvailableError,
    hub_model,
    llm_checkpoint_file,
    model_directory,
    served_name,
)
from serve_app.bench.http_load import free_port
from tests.engine.conftest import REPO_ID, V3_KIT_MODEL, hugging_face_cache

ROOT = Path(__file__).resolve().parents[2]
V1_KIT_MODEL = ROOT / "tests" / "fixtures" / "cosyvoice1-tiny" / "model"
ERROR_WITHIN_S = 15.0  # "in seconds": the CLI's whole run, Python's start included, on a busy 2-core machine


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("HF_")} | env
    return subprocess.run(
        [sys.executable, "-m", "serve_app.cli", *args], cwd=ROOT, env=environment, capture_output=True, text=True
    )


def test_hub_ids_are_told_from_presets_and_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hub_model(REPO_ID) == HubModel("huggingface", REPO_ID)
    assert hub_model("modelscope:iic/CosyVoice2-0.5B") == HubModel("modelscope", "iic/CosyVoice2-0.5B")
    assert str(hub_model("modelscope:iic/CosyVoice2-0.5B")) == "modelscope:iic/CosyVoice2-0.5B"
    for not_an_id in ("tiny", "cosyvoice3-0.5b", "/models/Fun-CosyVoice3-0.5B", "a/b/c", "./x", "../a/b"):
        assert hub_model(not_an_id) is None, not_an_id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert hub_model("models/mine") is None  # a directory that exists is a path, though it looks like an id
    with pytest.raises(ModelNotAvailableError, match="modelscope:<owner>/<name>"):
        hub_model("modelscope:no-owner")


def test_the_served_name_comes_from_the_id_or_the_directory() -> None:
    assert served_name(REPO_ID) == "Fun-CosyVoice3-0.5B-2512"
    assert served_name("modelscope:iic/CosyVoice2-0.5B") == "CosyVoice2-0.5B"
    assert served_name("/models/CosyVoice-300M-SFT") == "CosyVoice-300M-SFT"
    assert served_name("tiny") == "tiny"


def test_auto_picks_the_rl_llm_where_the_model_has_it(tmp_path: Path) -> None:
    (tmp_path / "llm.pt").write_bytes(b"")
    assert llm_checkpoint_file(tmp_path) == "llm.pt"
    (tmp_path / "llm.rl.pt").write_bytes(b"")
    assert llm_checkpoint_file(tmp_path) == "llm.rl.pt"
    assert llm_checkpoint_file(tmp_path, "llm.pt") == "llm.pt"
    with pytest.raises(CheckpointError, match=r"'llm.sft.pt' is not in .* \(its LLM checkpoints: llm.pt, llm.rl.pt\)"):
        llm_checkpoint_file(tmp_path, "llm.sft.pt")
    with pytest.raises(CheckpointError, match=r"'auto' or the file name of a \.pt"):
        llm_checkpoint_file(tmp_path, "../llm.pt")


def test_load_model_loads_the_checkpoint_it_picks(tmp_path: Path) -> None:
    """A model dir with an `llm.rl.pt` (here the official LLM with one weight changed): `auto` loads it and says so;
    `llm.pt` keeps the official LLM (what the parity tests load)."""
    model_dir = tmp_path / "model"
    shutil.copytree(V1_KIT_MODEL, model_dir)
    official = torch.load(model_dir / "llm.pt", weights_only=True)
    key = "llm_decoder.weight"
    tuned = {**official, key: official[key] + 1.0}
    torch.save(tuned, model_dir / "llm.rl.pt")

    loaded = load_model(model_dir, components=("decoder",), cpu_packing=False)
    assert loaded.llm_checkpoint == "llm.rl.pt"
    assert torch.equal(loaded.llm.state_dict()[key], tuned[key])
    kept = load_model(model_dir, components=("decoder",), cpu_packing=False, llm_checkpoint="llm.pt")
    assert kept.llm_checkpoint == "llm.pt" and torch.equal(kept.llm.state_dict()[key], official[key])
    assert load_model("tiny", components=("decoder",)).llm_checkpoint is None  # dummy weights


def test_a_hugging_face_id_is_served_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline (HF_HUB_OFFLINE) and with the hub unreachable (HF_ENDPOINT a closed local port), the id resolves to its
    cached snapshot; in process, a model loads from it under the id's name."""
    snapshot = hugging_face_cache(tmp_path, REPO_ID, V3_KIT_MODEL)
    unreachable = f"http://127.0.0.1:{free_port()}"
    for env in ({"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": unreachable}):
        result = cli("download", REPO_ID, env={"HF_HOME": str(tmp_path), **env})
        assert result.returncode == 0, result.stderr
        assert Path(result.stdout.strip()) == snapshot

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read from HF_HOME at its import
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert model_directory(REPO_ID) == snapshot
    loaded = load_model(REPO_ID, components=("encoder",))
    assert loaded.name == "Fun-CosyVoice3-0.5B-2512" and loaded.llm_checkpoint == "llm.pt"


@pytest.mark.parametrize(
    ("hub", "command"),
    [("offline", ["run", "--model"]), ("unreachable", ["download"])],
    ids=["run offline", "download unreachable"],
)
def test_an_id_that_cannot_be_had_is_refused_in_one_line_at_once(tmp_path: Path, hub: str, command: list[str]) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    env = {"HF_HOME": str(tmp_path), "HF_ENDPOINT": endpoint} | ({"HF_HUB_OFFLINE": "1"} if hub == "offline" else {})
    start = time.monotonic()
    port = ["--port", str(free_port())] if command[0] == "run" else []
    result = cli(*command, "FunAudioLLM/No-Such-Model", *port, env=env)
    assert time.monotonic() - start < ERROR_WITHIN_S
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: model FunAudioLLM/No-Such-Model is not in the Hugging Face cache ")
    assert str(tmp_path / "hub") in line
    assert ("HF_HUB_OFFLINE is set" if hub == "offline" else f"{endpoint} cannot be reached") in line
    assert "hf download FunAudioLLM/No-Such-Model --exclude '*.zip'" in line


@pytest.mark.skipif(importlib.util.find_spec("modelscope") is not None, reason="its client would go to the network")
def test_modelscope_without_its_client_is_a_clear_error() -> None:
    with pytest.raises(ModelNotAvailableError, match=r"pip install 'cosyvoice-serve\[modelscope\]'"):
        model_directory("modelscope:iic/CosyVoice2-0.5B")
