"""`ModelFamily`: what one CosyVoice generation does its own way, and the registry of the known families.

A family is found from the model yaml's LLM class (`family_for_llm_class`) or, in an official model directory,
from its config file's name (`family_for_config_file`). Each family module (`engine.families.cosyvoice1`, ...)
registers one `ModelFamily`; the loader, the stages, streaming, voice cloning, the deployments and the ingress ask
the model's family instead of testing its version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

from torch import nn

from engine.errors import CheckpointError, InvalidInputError
from engine.families.chunking import ChunkStrategy
from engine.loading.yaml_config import ObjectSpec, load_model_yaml
from engine.text.frontend import ENDOFPROMPT, TextTokenizer
from engine.voices.spec import CloningModels

# How a model takes instructions: in any voice (v1 -Instruct models), only in a registered (cloned) voice
# (CosyVoice2's instruct2), or not at all.
InstructionSupport = Literal["any_voice", "registered_voices", "none"]
MODULE_NAMES = ("llm", "flow", "hift")  # the modules of a model, each with its checkpoint `<name>.pt`


class ModuleConfigs(NamedTuple):
    llm: Any
    flow: Any
    hift: Any


@dataclass(frozen=True)
class VoiceRules:
    """How the family's official frontend writes the LLM's text prompt and conditions an instruct request
    (engine.runtime.encoder_stage applies them).

    A text that already holds `<|endofprompt|>` was written in the official form by its caller and is taken as
    written; otherwise the rules complete it, so that a caller never needs to type the tag.
    """

    # instruct2 keeps the voice's LLM embedding and its prompt speech in the flow (the LLM drops the prompt speech);
    # v1's instruct conditions the flow on the speaker embedding alone and gives the LLM no speaker embedding
    instruct_keeps_voice_prompt: bool
    # CosyVoice3's official prompts start with a system prompt ended by `<|endofprompt|>`: before the transcript
    # (zero-shot), the instruction (instruct2) or the text itself (cross-lingual); None: the family has none
    system_prompt: str | None = None

    def with_system_prompt(self, system_prompt: str, family_name: str) -> VoiceRules:
        """These rules with a caller's system prompt; InvalidInputError for a family that takes none."""
        if self.system_prompt is None:
            raise InvalidInputError(f"{family_name} models take no system prompt")
        return replace(self, system_prompt=system_prompt)

    def system_text(self) -> str:
        """The system prompt and its `<|endofprompt|>`, which lead a text with no other prompt; '' without one."""
        return "" if self.system_prompt is None else self.system_prompt + ENDOFPROMPT

    def transcript_prompt(self, transcript: str) -> str:
        """A zero-shot prompt text: the system text, then the voice's transcript."""
        return transcript if ENDOFPROMPT in transcript else self.system_text() + transcript

    def instruction_prompt(self, instruction: str) -> str:
        """An instruction in the official form, ending in `<|endofprompt|>` (v3: after the system prompt and a
        space): "Speak happily." -> "Speak happily.<|endofprompt|>" or
        "You are a helpful assistant. Speak happily.<|endofprompt|>"."""
        if ENDOFPROMPT in instruction:
            return instruction
        lead = "" if self.system_prompt is None else self.system_prompt + " "
        return f"{lead}{instruction.strip()}{ENDOFPROMPT}"


@dataclass(frozen=True, eq=False)  # eq=False: a family is one registered object, compared by identity
class ModelFamily:
    name: str  # "CosyVoice2": how messages name it
    version: int  # data only (reported by /v1/voices, recorded in cloned prompts): nothing branches on it
    config_file: str  # the yaml of an official model dir
    llm_class: str  # the class of the yaml's `llm` node, which tells the family of any yaml
    read_configs: Callable[[dict[str, Any], Path], ModuleConfigs]  # (yaml tree, model dir) -> module configs
    modules: Mapping[str, type[nn.Module]]  # MODULE_NAMES -> class, built from its config
    text_module: Callable[[nn.Module], nn.Module]  # the encoder-side text encoder, made from the LLM
    tokenizer: Callable[[ModelConfig, Path, bool], TextTokenizer]  # (config, yaml path, official dir?)
    voice_rules: VoiceRules
    instruction_support: Callable[[str], InstructionSupport]  # model name -> how it takes instructions
    # which of its models follow instructions, and in which voices, as a refusal names them to the caller
    instruction_models: str
    streaming: type[ChunkStrategy] | None  # None: streaming is refused (InvalidInputError)
    cloning: CloningModels | None  # None: voice cloning is refused (CheckpointError)
    # The LLM and flow overflow float16 (engine.nn.precision.decoder_dtypes): `auto` gives them bfloat16 on a GPU that
    # has it natively.
    prefers_bfloat16: bool = False
    # speech tokens the flow never gets past a run of 5 (the official llm_job: silent/breath codes)
    silent_tokens: frozenset[int] = frozenset()
    # the LLM takes text tokens as they come, mixed with speech (engine.llm.bistream): CosyVoice2/3, not v1
    bistream: bool = False
    # The languages its official model card lists (ISO 639 codes; yue: Cantonese), as clients that pick a voice by
    # language are told (Wyoming's describe); the front end spells out numbers in those beyond Chinese and English.
    languages: tuple[str, ...] = ()

    def cloning_models(self) -> CloningModels:
        """The family's cloning models; CheckpointError when it has none."""
        if self.cloning is None:
            raise CheckpointError(f"voice cloning is not available for {self.name} models")
        return self.cloning


@dataclass(frozen=True)
class ModelConfig:
    """All hyperparameters of a model, read from its yaml (v2/v3: and its Qwen2 config.json), and its family."""

    family: ModelFamily  # found from the yaml's LLM class (engine.families)
    sample_rate: int
    spk_embed_dim: int
    mel_bins: int
    llm: Any  # the family's LLM, flow and HiFT configs
    flow: Any
    hift: Any

    @property
    def version(self) -> int:
        """1: CosyVoice(-300M), 2: CosyVoice2, 3: CosyVoice3 (data for reports; behaviour asks the family)."""
        return self.family.version

    def speech_tokens_for(self, audio_seconds: float) -> int:
        """The fewest speech tokens whose audio (the flow's mel frames x the vocoder's samples per frame) lasts at
        least `audio_seconds`: 50 per second for CosyVoice v1, 25 for CosyVoice2 and 3."""
        samples, tokens = audio_seconds * self.sample_rate, 1
        while self.flow.mel_frames_of(tokens) * self.hift.hop < samples:
            tokens += 1
        return tokens

    @property
    def speech_token_rate(self) -> int:
        """Speech tokens per second of audio: 50 for CosyVoice v1, 25 for CosyVoice2 and 3."""
        return round(self.speech_tokens_for(100.0) / 100)

    @classmethod
    def from_yaml_file(cls, path: Path) -> ModelConfig:
        tree = load_model_yaml(path)
        for key in ("llm", "flow", "hift", "sample_rate"):
            if key not in tree:
                raise CheckpointError(f"model config {path} has no '{key}' entry")
        if not isinstance(tree["llm"], ObjectSpec):
            raise CheckpointError(f"model config {path}: 'llm' is not a `!new:` class node")
        # The LLM class tells the family: a dummy yaml may have any file name, but an official one must agree.
        family = family_for_llm_class(tree["llm"].class_name)
        named = family_for_config_file(path.name)
        if named is not None and named is not family:
            raise CheckpointError(
                f"model config {path} is named as a {named.name} config, but its LLM class {family.llm_class} is "
                f"{family.name}'s"
            )
        configs = family.read_configs(tree, path.parent)
        return cls(
            family=family,
            sample_rate=int(tree["sample_rate"]),
            spk_embed_dim=int(tree.get("spk_embed_dim", 192)),
            mel_bins=int(tree["flow"].get("output_size", 80)),
            llm=configs.llm,
            flow=configs.flow,
            hift=configs.hift,
        )


_FAMILIES: list[ModelFamily] = []


def register(family: ModelFamily) -> ModelFamily:
    """Add a family to the registry; its LLM class and config file name must be its own."""
    for known in _FAMILIES:
        if known.llm_class == family.llm_class or known.config_file == family.config_file:
            raise ValueError(f"{family.name} reuses the LLM class or config file of {known.name}")
    if set(family.modules) != set(MODULE_NAMES):
        raise ValueError(f"{family.name} must name a module class for each of {MODULE_NAMES}")
    _FAMILIES.append(family)
    return family


def families() -> tuple[ModelFamily, ...]:
    """Every registered family, in registration order (v1 first)."""
    return tuple(_FAMILIES)


def family_for_llm_class(class_name: str) -> ModelFamily:
    """The family whose yaml `llm` node has class `class_name`; CheckpointError naming the known ones otherwise."""
    for family in _FAMILIES:
        if family.llm_class == class_name:
            return family
    known = ", ".join(f"{family.llm_class} ({family.name})" for family in _FAMILIES)
    raise CheckpointError(f"unknown LLM class {class_name!r} in the model yaml; the known classes are {known}")


def family_for_config_file(file_name: str) -> ModelFamily | None:
    """The family whose official model dir holds a config named `file_name`; None for any other name."""
    return next((family for family in _FAMILIES if family.config_file == file_name), None)


def models_following_instructions() -> str:
    """The models of every registered family that follow instructions, for a refusal: "CosyVoice v1 -Instruct
    models (in any voice), CosyVoice2 models (in a registered voice) and ..."."""
    *others, last = (family.instruction_models for family in _FAMILIES)
    return f"{', '.join(others)} and {last}" if others else last


def registered_voices_only(model_name: str) -> InstructionSupport:
    """instruct2 (CosyVoice2 and later): every model follows instructions, spoken in a registered voice."""
    return "registered_voices"
