"""The HyperPyYAML reader and the strict checkpoint loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.errors import CheckpointError
from engine.loading.checkpoint import load_strict, read_state_dict
from engine.loading.loader import load_model
from engine.loading.yaml_config import ObjectSpec, load_model_yaml


def test_official_yaml_parses_without_executing_tags(conformance_kit: Path) -> None:
    tree = load_model_yaml(conformance_kit / "model" / "cosyvoice.yaml")
    assert isinstance(tree["llm"], ObjectSpec) and tree["llm"].class_name == "TransformerLM"
    # !ref is resolved to the referenced top-level value
    assert tree["llm"]["llm_input_size"] == tree["llm_input_size"]
    assert tree["hift"]["sampling_rate"] == tree["sample_rate"]
    # !apply (the seeding side effects) is not run
    assert tree["__set_seed1"] is None


def test_ref_arithmetic_and_scientific_floats(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "chunk: 25\nratio: 2\nsigma: 1e-06\nnode: !new:a.B\n    size: !ref <chunk> * <ratio>\n    items: !ref <lst>\n"
        "lst: [1, 2]\n",
        encoding="utf-8",
    )
    tree = load_model_yaml(path)
    assert tree["node"]["size"] == 50
    assert tree["node"]["items"] == [1, 2]
    assert tree["sigma"] == pytest.approx(1e-6) and isinstance(tree["sigma"], float)


@pytest.mark.parametrize(
    "text",
    ["a: !ref <missing>\n", "a: [unclosed\n", "- just\n- a list\n", "a: !new:x.Y [1, 2]\n", "a: !ref <a>\n"],
)
def test_malformed_yaml_is_a_checkpoint_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"bad\.yaml"):
        load_model_yaml(path)


def test_missing_yaml_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nope\.yaml"):
        load_model_yaml(tmp_path / "nope.yaml")


def test_read_state_dict_rejects_missing_unsafe_and_non_state_dict_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="missing"):
        read_state_dict(tmp_path / "llm.pt")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"garbage\.pt"):
        read_state_dict(garbage)
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"w": torch.zeros(1), "obj": nn.Linear(1, 1)}, unsafe)  # a module needs full unpickling
    with pytest.raises(CheckpointError, match=r"unsafe\.pt"):
        read_state_dict(unsafe)
    not_tensors = tmp_path / "ints.pt"
    torch.save({"w": 3}, not_tensors)
    with pytest.raises(CheckpointError, match="not a state dict"):
        read_state_dict(not_tensors)


def test_load_strict_names_missing_unexpected_and_misshaped_keys() -> None:
    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    state = {k: v.clone() for k, v in module.state_dict().items()}
    del state["1.bias"]
    state["extra.weight"] = torch.zeros(1)
    state["0.weight"] = torch.zeros(4, 2)
    with pytest.raises(CheckpointError) as info:
        load_strict(module, state, "llm.pt")
    message = str(info.value)
    assert "llm.pt" in message
    assert "missing keys: 1.bias" in message
    assert "unexpected keys: extra.weight" in message
    assert "0.weight (file (4, 2), model (3, 2))" in message


def test_load_strict_accepts_an_exact_state_dict() -> None:
    source, target = nn.Linear(2, 3), nn.Linear(2, 3)
    load_strict(target, source.state_dict(), "x.pt")
    assert torch.equal(target.weight, source.weight)


WHISPER_ENTRY = "get_tokenizer: !name:whisper.tokenizer.get_tokenizer\n"


def _kit_copy_with_tokenizer(kit: Path, tmp_path: Path, get_tokenizer: str) -> Path:
    """The kit's model dir (checkpoints linked) with the yaml's `get_tokenizer` entry replaced."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        (model / name).symlink_to(kit / "model" / name)
    yaml = (kit / "model" / "cosyvoice.yaml").read_text(encoding="utf-8")
    start = yaml.index("get_tokenizer:")
    end = yaml.index("allowed_special:", start)
    (model / "cosyvoice.yaml").write_text(yaml[:start] + get_tokenizer + yaml[end:], encoding="utf-8")
    return model


@pytest.mark.parametrize(("languages", "vocab"), [(100, 51866), (99, 51865)])
def test_the_v1_tokenizer_follows_the_yaml(conformance_kit: Path, tmp_path: Path, languages: int, vocab: int) -> None:
    entry = f"{WHISPER_ENTRY}    multilingual: True\n    num_languages: {languages}\n"
    model = load_model(_kit_copy_with_tokenizer(conformance_kit, tmp_path, entry), components=("encoder",))
    assert model.frontend.tokenizer.vocab_size == vocab
    # the timestamps follow the language tokens, so their ids move with num_languages
    assert model.frontend.tokenize("<|0.00|>") == [vocab - 1501]


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ("get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_tokenizer\n    multilingual: True\n", "not supported"),
        (f"{WHISPER_ENTRY}    multilingual: False\n", "multilingual"),
        (f"{WHISPER_ENTRY}    multilingual: True\n    num_languages: 101\n", "101"),
    ],
)
def test_an_unsupported_v1_tokenizer_is_refused_by_name(
    conformance_kit: Path, tmp_path: Path, entry: str, needle: str
) -> None:
    with pytest.raises(CheckpointError, match=needle):
        load_model(_kit_copy_with_tokenizer(conformance_kit, tmp_path, entry), components=("encoder",))
