"""The model-family registry (engine.families): each family is found from its yaml's LLM class, an unknown class
or a misnamed config is refused by name, and what a family has not built (a streaming strategy) is refused clearly."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.errors import CheckpointError, InvalidInputError
from engine.families import (
    COSYVOICE1,
    COSYVOICE2,
    COSYVOICE3,
    ModelFamily,
    families,
    family_for_config_file,
    family_for_llm_class,
    models_following_instructions,
    register,
)
from engine.families.base import ModelConfig
from engine.families.chunking import CausalPrefixChunks, CausalPrefixRerunChunks, OverlappingChunks
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import PRESETS, PRESETS_DIR, load_model
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.scheduler import Scheduler
from engine.runtime.segment import EncodedSegment
from engine.runtime.streaming import DecodeStream

PRESET_FAMILIES = {"tiny": COSYVOICE1, "cosyvoice2-tiny": COSYVOICE2, "cosyvoice3-tiny": COSYVOICE3}


def test_the_three_families_are_registered_by_llm_class_and_config_file() -> None:
    assert families() == (COSYVOICE1, COSYVOICE2, COSYVOICE3)
    for family, llm_class, config_file in (
        (COSYVOICE1, "TransformerLM", "cosyvoice.yaml"),
        (COSYVOICE2, "Qwen2LM", "cosyvoice2.yaml"),
        (COSYVOICE3, "CosyVoice3LM", "cosyvoice3.yaml"),
    ):
        assert family_for_llm_class(llm_class) is family
        assert family_for_config_file(config_file) is family
    assert family_for_config_file("tiny.yaml") is None


@pytest.mark.parametrize("preset", list(PRESET_FAMILIES))
def test_each_family_is_found_from_its_yaml_class_and_builds_its_modules(preset: str) -> None:
    model = load_model(preset, cpu_packing=False)
    family = PRESET_FAMILIES[preset]
    assert model.config.family is family and model.config.version == family.version
    for name, module_class in family.modules.items():
        assert type(getattr(model, name)) is module_class, name


def test_each_kit_is_found_from_its_yaml_class(each_kit: Path) -> None:
    [config_file] = [f for f in families() if (each_kit / "model" / f.config_file).is_file()]
    assert ModelConfig.from_yaml_file(each_kit / "model" / config_file.config_file).family is config_file


def test_an_unknown_llm_class_names_the_known_ones(tmp_path: Path) -> None:
    text = (PRESETS_DIR / PRESETS["tiny"]).read_text(encoding="utf-8")
    assert "cosyvoice.llm.llm.TransformerLM" in text
    path = tmp_path / "mystery.yaml"
    path.write_text(text.replace("cosyvoice.llm.llm.TransformerLM", "cosyvoice.llm.llm.MysteryLM"), encoding="utf-8")
    with pytest.raises(CheckpointError) as error:
        ModelConfig.from_yaml_file(path)
    message = error.value.message
    assert "unknown LLM class 'MysteryLM'" in message
    for family in families():
        assert f"{family.llm_class} ({family.name})" in message


def test_an_official_config_whose_name_and_llm_class_disagree_is_refused(tmp_path: Path) -> None:
    shutil.copy(PRESETS_DIR / PRESETS["tiny"], tmp_path / "cosyvoice2.yaml")  # a v1 yaml under the v2 name
    with pytest.raises(CheckpointError, match="named as a CosyVoice2 config, but its LLM class TransformerLM"):
        ModelConfig.from_yaml_file(tmp_path / "cosyvoice2.yaml")


def test_a_model_dir_with_two_family_configs_is_refused(tmp_path: Path) -> None:
    for name in ("cosyvoice.yaml", "cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt"):
        (tmp_path / name).write_text("")
    with pytest.raises(CheckpointError, match=r"exactly one of cosyvoice\.yaml .*; it holds cosyvoice\.yaml, cosy"):
        load_model(tmp_path)


def test_a_family_cannot_reuse_another_ones_llm_class() -> None:
    with pytest.raises(ValueError, match="reuses the LLM class or config file of CosyVoice2"):
        register(ModelFamily(**{**COSYVOICE2.__dict__, "name": "Copy", "config_file": "copy.yaml"}))
    assert families() == (COSYVOICE1, COSYVOICE2, COSYVOICE3)


def test_instruction_support_per_family() -> None:
    assert COSYVOICE1.instruction_support("CosyVoice-300M-Instruct") == "any_voice"
    assert COSYVOICE1.instruction_support("CosyVoice-300M-SFT") == "none"
    assert COSYVOICE2.instruction_support("CosyVoice2-0.5B") == "registered_voices"
    assert COSYVOICE3.instruction_support("Fun-CosyVoice3-0.5B") == "registered_voices"


def test_a_refusal_names_the_models_of_every_family_that_follow_instructions() -> None:
    # the ingress asks the registry, so a new family is named without a change there
    assert models_following_instructions() == (
        "CosyVoice v1 -Instruct models (in any voice), CosyVoice2 models (in a registered voice) and "
        "CosyVoice3 models (in a registered voice)"
    )


@pytest.mark.parametrize(
    ("family", "official_form"),
    [
        (COSYVOICE1, "Speak happily.<|endofprompt|>"),
        (COSYVOICE2, "Speak happily.<|endofprompt|>"),
        (COSYVOICE3, "You are a helpful assistant. Speak happily.<|endofprompt|>"),
    ],
)
def test_each_family_writes_a_plain_instruction_in_its_official_form_once(
    family: ModelFamily, official_form: str
) -> None:
    rules = family.voice_rules
    assert rules.instruction_prompt("Speak happily.") == rules.instruction_prompt(" Speak happily. \n") == official_form
    assert rules.instruction_prompt(official_form) == official_form  # an instruction in the official form as it is
    tagged = "Whisper.<|endofprompt|>"
    assert rules.instruction_prompt(tagged) == tagged


def test_only_cosyvoice3_has_a_system_prompt_and_a_caller_may_replace_it() -> None:
    assert COSYVOICE1.voice_rules.system_text() == COSYVOICE2.voice_rules.system_text() == ""
    assert COSYVOICE3.voice_rules.system_text() == "You are a helpful assistant.<|endofprompt|>"
    assert COSYVOICE3.voice_rules.transcript_prompt("Hi.") == "You are a helpful assistant.<|endofprompt|>Hi."
    assert COSYVOICE2.voice_rules.transcript_prompt("Hi.") == "Hi."
    own = COSYVOICE3.voice_rules.with_system_prompt("You read the news.", COSYVOICE3.name)
    assert own.instruction_prompt("Slowly.") == "You read the news. Slowly.<|endofprompt|>"
    with pytest.raises(InvalidInputError, match=r"^CosyVoice2 models take no system prompt$"):
        COSYVOICE2.voice_rules.with_system_prompt("You read the news.", COSYVOICE2.name)


def test_streaming_strategy_and_silent_tokens_per_family() -> None:
    assert (COSYVOICE1.streaming, COSYVOICE2.streaming) == (OverlappingChunks, CausalPrefixChunks)
    assert COSYVOICE3.streaming is CausalPrefixRerunChunks
    assert COSYVOICE1.silent_tokens == COSYVOICE2.silent_tokens == frozenset()  # official: [] before CosyVoice3
    assert COSYVOICE3.silent_tokens == {1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323}


@pytest.fixture
def decoder_without_streaming(monkeypatch: pytest.MonkeyPatch) -> SpeechDecoderStage:
    """The v3 preset's decoder as a family without a streaming strategy would have it."""
    decoder = SpeechDecoderStage(load_model("cosyvoice3-tiny", components=("decoder",)))
    config = decoder.model.config
    family = dataclasses.replace(COSYVOICE3, streaming=None)
    monkeypatch.setattr(decoder.model, "config", dataclasses.replace(config, family=family))
    return decoder


def test_a_family_without_a_streaming_strategy_refuses_streams_with_a_clear_400(
    decoder_without_streaming: SpeechDecoderStage,
) -> None:
    decoder = decoder_without_streaming
    config = decoder.model.config
    segment = EncodedSegment(
        text_encoded=np.zeros((4, config.llm.qwen.hidden_size), dtype=np.float32),
        text_len=2,
        llm_embedding=np.zeros(192, dtype=np.float32),
        flow_embedding=np.zeros(192, dtype=np.float32),
        llm_prompt_speech_tokens=np.zeros(0, dtype=np.int64),
        flow_prompt_speech_tokens=np.zeros(0, dtype=np.int64),
        prompt_feat=np.zeros((0, config.mel_bins), dtype=np.float32),
        sampling=SamplingOptions(seed=0),
        speed=1.0,
    )
    with pytest.raises(InvalidInputError, match=r"^CosyVoice3 models cannot stream yet: .* the request whole") as e:
        decoder.open_stream([segment])
    assert e.value.http_status == 400
    # a decoder loop still builds its (empty) stream for every family, and a refused segment takes no LLM row
    stream = DecodeStream(decoder, [])
    with pytest.raises(InvalidInputError, match="cannot stream yet"):
        stream.add(segment)
    assert stream.llm.batch_size == 0 and stream.emit() == [] and stream.finished
    assert Scheduler(decoder, max_live=2).streams.strategy is None
