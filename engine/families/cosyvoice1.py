"""CosyVoice v1 (CosyVoice-300M, -SFT, -Instruct): `TransformerLM`, the Conformer + U-Net CFM flow, HiFT at 22.05 kHz.

Whisper's multilingual tokenizer, streaming in overlapping chunks with the flow cache, instructions only in the
-Instruct models (in any voice), 50 Hz speech tokens for cloning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from engine.families.base import InstructionSupport, ModelFamily, ModuleConfigs, VoiceRules, register
from engine.families.chunking import OverlappingChunks
from engine.flow.masked_diff import FlowConfig, MaskedDiffWithXvec
from engine.llm.transformer_lm import LLMConfig, TransformerLM
from engine.loading.yaml_config import load_model_yaml
from engine.text.frontend import WhisperTokenizer
from engine.vocoder.hift import HiFTConfig, HiFTGenerator
from engine.voices.spec import CloningModels, PromptMelConfig

INSTRUCT_MODEL_MARK = "-Instruct"  # the official v1 models trained to follow instructions are named so


def _read_configs(tree: dict[str, Any], model_dir: Path) -> ModuleConfigs:
    return ModuleConfigs(
        llm=LLMConfig.from_yaml(tree["llm"]),
        flow=FlowConfig.from_yaml(tree["flow"]),
        hift=HiFTConfig.from_yaml(tree["hift"]),
    )


def _llm_encodes_text(llm: nn.Module) -> nn.Module:
    """The v1 LLM encodes text itself (text embedding + Conformer): the encoder stage keeps the whole module."""
    return llm


def _yaml_tokenizer(config: Any, config_path: Path, official: bool) -> WhisperTokenizer:
    """The tokenizer the yaml's `get_tokenizer` names (whisper's multilingual one)."""
    return WhisperTokenizer.from_yaml(load_model_yaml(config_path).get("get_tokenizer"))


def _instruct_models_only(model_name: str) -> InstructionSupport:
    return "any_voice" if INSTRUCT_MODEL_MARK in model_name else "none"


COSYVOICE1 = register(
    ModelFamily(
        name="CosyVoice v1",
        version=1,
        config_file="cosyvoice.yaml",
        llm_class="TransformerLM",
        read_configs=_read_configs,
        modules={"llm": TransformerLM, "flow": MaskedDiffWithXvec, "hift": HiFTGenerator},
        text_module=_llm_encodes_text,
        tokenizer=_yaml_tokenizer,
        voice_rules=VoiceRules(instruct_keeps_voice_prompt=False),
        instruction_support=_instruct_models_only,
        instruction_models=f"CosyVoice v1 {INSTRUCT_MODEL_MARK} models (in any voice)",
        streaming=OverlappingChunks,
        languages=("zh", "en", "ja", "yue", "ko"),
        cloning=CloningModels(
            version=1,
            speech_tokenizer_file="speech_tokenizer_v1.onnx",
            speech_vocab_size=4096,
            token_rate=50,
            prompt_mel=PromptMelConfig(sample_rate=22050, n_fft=1024, hop_length=256, win_length=1024),
            frames_per_token=None,  # v1 interpolates tokens to frames: the prompt is kept as it is
        ),
    )
)
