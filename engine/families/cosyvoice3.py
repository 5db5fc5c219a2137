"""CosyVoice3 (Fun-CosyVoice3-0.5B): `CosyVoice3LM`, the DiT flow, the causal HiFT at 24 kHz.

The Qwen2 tokenizer with CosyVoice3's special tokens (`<|endofprompt|>` must be id 151646, which the LLM
requires in every input), the official prompt convention (a system prompt ended by `<|endofprompt|>` before the
transcript, the instruction or the text), instruct2, and cloning with `speech_tokenizer_v3.onnx` (25 Hz) and a
24 kHz prompt mel without an upper band edge. Streaming: the CosyVoice2
chunks with the causal vocoder re-run (`CausalPrefixRerunChunks`); the official silent-token filter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import CheckpointError
from engine.families.base import ModelFamily, ModuleConfigs, VoiceRules, register, registered_voices_only
from engine.families.chunking import CausalPrefixRerunChunks
from engine.families.cosyvoice2 import qwen_tokenizer
from engine.flow.dit import CausalMaskedDiffWithDiT, DiTFlowConfig
from engine.llm.cosyvoice3_lm import ENDOFPROMPT_TOKEN, CosyVoice3LM, CosyVoice3LMConfig, CosyVoice3TextEmbedding
from engine.llm.qwen2_lm import QWEN_DIR
from engine.text.frontend import ENDOFPROMPT
from engine.text.qwen_tokenizer import COSYVOICE3_SPECIAL_TOKENS, QWEN2_ENDOFTEXT_ID, QwenTokenizer
from engine.vocoder.causal_hift import CausalHiFTConfig, CausalHiFTGenerator
from engine.voices.spec import CloningModels, PromptMelConfig

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."  # the official examples' system prompt

# The official CosyVoice3Model.silent_tokens: FSQ codes of silence and breath in the 6561-token codebook
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})


def _read_configs(tree: dict[str, Any], model_dir: Path) -> ModuleConfigs:
    return ModuleConfigs(
        llm=CosyVoice3LMConfig.from_yaml(tree["llm"], model_dir),
        flow=DiTFlowConfig.from_yaml(tree["flow"]),
        hift=CausalHiFTConfig.from_yaml(tree["hift"]),
    )


def _tokenizer(config: Any, config_path: Path, official: bool) -> QwenTokenizer:
    """`CosyVoice3Tokenizer`'s ids (its stand-in gives every special token its released id); CheckpointError
    unless `<|endofprompt|>` is the single id the LLM requires."""
    tokenizer = qwen_tokenizer(config, config_path, official, COSYVOICE3_SPECIAL_TOKENS, QWEN2_ENDOFTEXT_ID)
    ids = tokenizer.encode(ENDOFPROMPT)
    if ids != [ENDOFPROMPT_TOKEN]:
        raise CheckpointError(
            f"the tokenizer in {config_path.parent / QWEN_DIR} gives {ENDOFPROMPT} the id(s) {ids}; the CosyVoice3 "
            f"LLM requires the single id {ENDOFPROMPT_TOKEN}: use the model's own tokenizer files"
        )
    return tokenizer


COSYVOICE3 = register(
    ModelFamily(
        name="CosyVoice3",
        version=3,
        config_file="cosyvoice3.yaml",
        llm_class="CosyVoice3LM",
        read_configs=_read_configs,
        modules={"llm": CosyVoice3LM, "flow": CausalMaskedDiffWithDiT, "hift": CausalHiFTGenerator},
        text_module=CosyVoice3TextEmbedding,
        tokenizer=_tokenizer,
        # instruct2 with the system prompt: "You are a helpful assistant. <instruction><|endofprompt|>"
        voice_rules=VoiceRules(instruct_keeps_voice_prompt=True, system_prompt=DEFAULT_SYSTEM_PROMPT),
        instruction_support=registered_voices_only,
        instruction_models="CosyVoice3 models (in a registered voice)",
        bistream=True,
        streaming=CausalPrefixRerunChunks,
        languages=("zh", "en", "ja", "ko", "de", "es", "fr", "it", "ru", "yue"),
        cloning=CloningModels(
            version=3,
            speech_tokenizer_file="speech_tokenizer_v3.onnx",
            speech_vocab_size=6561,
            token_rate=25,
            # the v3 yaml's feat_extractor has fmax null: the filters reach half the sample rate
            prompt_mel=PromptMelConfig(sample_rate=24000, n_fft=1920, hop_length=480, win_length=1920, fmax=None),
            frames_per_token=2,  # the flow repeats each token's lookahead output twice
        ),
        prefers_bfloat16=True,  # upstream reports NaN audio from its float16 DiT flow
        silent_tokens=SILENT_TOKENS,
    )
)
