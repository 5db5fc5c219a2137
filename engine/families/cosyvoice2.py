"""CosyVoice2 (CosyVoice2-0.5B): the Qwen2 `Qwen2LM`, the causal Conformer + U-Net CFM flow, HiFT at 24 kHz.

The Qwen2 tokenizer of the model dir (a byte-level stand-in for dummy weights), streaming over the causal token
prefix, instruct2 (an instruction in a registered voice, taken as given), 25 Hz speech tokens for cloning with
2 prompt mel frames per token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.families.base import ModelFamily, ModuleConfigs, VoiceRules, register, registered_voices_only
from engine.families.chunking import CausalPrefixChunks
from engine.flow.causal import CausalFlowConfig, CausalMaskedDiffWithXvec
from engine.llm.qwen2_lm import QWEN_DIR, Qwen2LM, Qwen2LMConfig, Qwen2TextEmbedding
from engine.text.qwen_tokenizer import COSYVOICE2_SPECIAL_TOKENS, QwenTokenizer
from engine.vocoder.hift import HiFTConfig, HiFTGenerator
from engine.voices.spec import CloningModels, PromptMelConfig

# instruct2: the instruction takes the transcript's place; the prompt speech stays in the flow
INSTRUCT2 = VoiceRules(instruct_keeps_voice_prompt=True)


def _read_configs(tree: dict[str, Any], model_dir: Path) -> ModuleConfigs:
    return ModuleConfigs(
        llm=Qwen2LMConfig.from_yaml(tree["llm"], model_dir),
        flow=CausalFlowConfig.from_yaml(tree["flow"]),
        hift=HiFTConfig.from_yaml(tree["hift"]),
    )


def qwen_tokenizer(
    config: Any,
    config_path: Path,
    official: bool,
    special_tokens: tuple[str, ...] = COSYVOICE2_SPECIAL_TOKENS,
    stand_in_endoftext_id: int = 256,
) -> QwenTokenizer:
    """The Qwen2 tokenizer of an official model dir with the family's `special_tokens`, or its byte-level stand-in
    for dummy weights (`<|endoftext|>` at `stand_in_endoftext_id`). Ids the LLM does not embed are refused per
    request (`engine.llm.qwen2_lm.embed_text`), as a model dir whose table ends before the last special tags loads
    officially."""
    if official:
        return QwenTokenizer.from_dir(config_path.parent / QWEN_DIR, special_tokens)
    return QwenTokenizer.byte_level(special_tokens, stand_in_endoftext_id)


COSYVOICE2 = register(
    ModelFamily(
        name="CosyVoice2",
        version=2,
        config_file="cosyvoice2.yaml",
        llm_class="Qwen2LM",
        read_configs=_read_configs,
        modules={"llm": Qwen2LM, "flow": CausalMaskedDiffWithXvec, "hift": HiFTGenerator},
        text_module=Qwen2TextEmbedding,  # the encoder keeps only the Qwen2 embedding table
        tokenizer=qwen_tokenizer,
        voice_rules=INSTRUCT2,
        instruction_support=registered_voices_only,
        instruction_models="CosyVoice2 models (in a registered voice)",
        bistream=True,
        streaming=CausalPrefixChunks,
        languages=("zh", "en", "ja", "ko", "yue"),
        cloning=CloningModels(
            version=2,
            speech_tokenizer_file="speech_tokenizer_v2.onnx",
            speech_vocab_size=6561,
            token_rate=25,
            prompt_mel=PromptMelConfig(sample_rate=24000, n_fft=1920, hop_length=480, win_length=1920),
            frames_per_token=2,  # the flow upsamples tokens x2
        ),
    )
)
