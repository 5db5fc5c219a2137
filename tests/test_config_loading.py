"""The HyperPyYAML reader and the strict checkpoint loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.checkpoint import load_strict, read_state_dict
from engine.errors import CheckpointError
from engine.yaml_config import ObjectSpec, load_model_yaml


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
