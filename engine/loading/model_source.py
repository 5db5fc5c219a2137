"""Where a model comes from, and which of its LLM checkpoints is loaded.

A model source is a preset name (`engine.loading.loader.PRESETS`), a local model directory, a Hugging Face model id
(`FunAudioLLM/Fun-CosyVoice3-0.5B-2512`, as vLLM and every Hugging Face tool take one) or `modelscope:<id>`. An id is
resolved into its hub's cache with the hub's own client: `huggingface_hub.snapshot_download` honours HF_HOME (or
HF_HUB_CACHE), HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE, shows a progress bar, resumes a cut download, and offline or
when the hub cannot be reached answers from the cache. Every process that loads the model resolves the id itself, so
each node of a cluster fills its own cache (or reads a shared one). Nothing here imports torch: the CLI resolves a
model before it starts Ray.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from engine.errors import CheckpointError

MODELSCOPE_PREFIX = "modelscope:"
# A hub repo id: owner/name of letters, digits, '-', '_', '.' (what both hubs accept), not starting with '.' or '-'.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# Files of the official repos the engine never reads: the JIT and TensorRT/ONNX exports of the official runtimes,
# the batched speech tokenizer, and the Qwen2 weights beside the tokenizer (the LLM's weights are in llm.pt).
UNUSED_FILES = ("*.zip", "*.plan", "flow.decoder.estimator*", "*.batch.onnx", "CosyVoice-BlankEN/*.safetensors")
# What the model's sizes are read from (engine.loading.loader.model_sizes): its yaml and the Qwen2 config of v2 / v3.
CONFIG_FILES = ("*.yaml", "CosyVoice-BlankEN/config.json")

LLM_CHECKPOINT_AUTO = "auto"
OFFICIAL_LLM_CHECKPOINT = "llm.pt"
# Fun-CosyVoice3-0.5B-2512's RL-tuned LLM (same architecture; the official README's table: lower CER and WER)
RL_LLM_CHECKPOINT = "llm.rl.pt"
_CHECKPOINT_NAME = re.compile(r"[\w.-]+\.pt")


class ModelNotAvailableError(CheckpointError):
    """A hub model that is neither in the cache nor downloadable: offline, the hub unreachable, an unknown id."""


@dataclass(frozen=True)
class HubModel:
    """A model named by its hub id."""

    hub: str  # "huggingface" or "modelscope"
    repo_id: str

    @property
    def name(self) -> str:
        """The served name: the repo's name without its owner."""
        return self.repo_id.rsplit("/", 1)[1]

    def __str__(self) -> str:
        return self.repo_id if self.hub == "huggingface" else MODELSCOPE_PREFIX + self.repo_id


def hub_model(source: str) -> HubModel | None:
    """The hub model `source` names, or None for a preset or a path. `modelscope:<id>` is ModelScope's; an
    `owner/name` that is no existing directory is a Hugging Face id."""
    if source.startswith(MODELSCOPE_PREFIX):
        repo_id = source.removeprefix(MODELSCOPE_PREFIX)
        if not _REPO_ID.fullmatch(repo_id):
            raise ModelNotAvailableError(f"{source!r}: a ModelScope model is modelscope:<owner>/<name>")
        return HubModel("modelscope", repo_id)
    if _REPO_ID.fullmatch(source) and not Path(source).exists():
        return HubModel("huggingface", source)
    return None


def served_name(source: str) -> str:
    """The name the server answers to for `source`: a hub model's repo name, a directory's or preset's own name."""
    model = hub_model(source)
    return model.name if model is not None else Path(source).name


def model_directory(source: str, config_only: bool = False) -> Path:
    """The local directory of `source`: a path as it is; a hub id's snapshot in its hub's cache, downloaded first
    where it is missing or stale (ModelNotAvailableError, one line naming the id, where it looked and how to fetch it
    by hand, where it can be neither found nor downloaded). `config_only`: of a hub id only CONFIG_FILES (a plan
    needs no weights)."""
    model = hub_model(source)
    if model is None:
        return Path(source)
    wanted = list(CONFIG_FILES) if config_only else None
    if model.hub == "modelscope":
        return _modelscope_snapshot(model, wanted)
    return _huggingface_snapshot(model, wanted)


def _huggingface_snapshot(model: HubModel, wanted: list[str] | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    endpoint = constants.ENDPOINT
    try:
        return Path(snapshot_download(model.repo_id, allow_patterns=wanted, ignore_patterns=list(UNUSED_FILES)))
    except GatedRepoError as exc:
        reason = f"{endpoint} refuses it without access (HTTP {exc.response.status_code}; set HF_TOKEN)"
    except RepositoryNotFoundError:
        reason = f"{endpoint} has no model of that id"
    except LocalEntryNotFoundError:
        reason = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{endpoint} cannot be reached"
    except HfHubHTTPError as exc:
        reason = f"{endpoint} answered HTTP {exc.response.status_code}"
    excluded = " ".join(shlex.quote(pattern) for pattern in UNUSED_FILES)
    raise ModelNotAvailableError(
        f"model {model} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and {reason}; fetch it by hand "
        f"with `hf download {model.repo_id} --exclude {excluded}` where {endpoint} is reachable and bring that "
        "cache here (HF_HOME), or pass --model a local model directory"
    ) from None


def _modelscope_snapshot(model: HubModel, wanted: list[str] | None) -> Path:
    try:
        from modelscope import snapshot_download
    except ImportError:
        raise ModelNotAvailableError(
            f"model {model}: ModelScope's client is not installed: pip install 'cosyvoice-serve[modelscope]'"
        ) from None
    try:
        return Path(snapshot_download(model.repo_id, allow_file_pattern=wanted, ignore_file_pattern=list(UNUSED_FILES)))
    except Exception as exc:  # its client raises many kinds (HTTP, offline, unknown id): all mean "not available"
        cache = os.environ.get("MODELSCOPE_CACHE", "~/.cache/modelscope")
        raise ModelNotAvailableError(
            f"model {model}: ModelScope could not provide it ({type(exc).__name__}: {exc}); looked in {cache}; fetch "
            f"it by hand with `modelscope download --model {model.repo_id}` or pass --model a local model directory"
        ) from None


def llm_checkpoint_file(model_dir: Path, setting: str = LLM_CHECKPOINT_AUTO) -> str:
    """The LLM checkpoint of an official model dir that `setting` picks: `auto` takes the RL-tuned `llm.rl.pt` where
    the model has one (Fun-CosyVoice3-0.5B-2512), else `llm.pt`; another setting is a file name in the dir."""
    if setting == LLM_CHECKPOINT_AUTO:
        return RL_LLM_CHECKPOINT if (model_dir / RL_LLM_CHECKPOINT).is_file() else OFFICIAL_LLM_CHECKPOINT
    if not _CHECKPOINT_NAME.fullmatch(setting):
        raise CheckpointError(f"llm_checkpoint {setting!r}: 'auto' or the file name of a .pt in the model directory")
    if not (model_dir / setting).is_file():
        present = ", ".join(sorted(path.name for path in model_dir.glob("llm*.pt"))) or "none"
        raise CheckpointError(f"llm_checkpoint {setting!r} is not in {model_dir} (its LLM checkpoints: {present})")
    return setting
