"""CosyVoice3 (Fun-CosyVoice3-0.5B): `CosyVoice3LM`, the DiT flow, the causal HiFT at 24 kHz.

Built so far: loading, whole-utterance synthesis with CosyVoice3's tokenizer (`<|endofprompt|>` must be id 151646,
which the LLM requires in every input) and instruct2 rules. Not built yet, each with its place below: streaming
(refused with an InvalidInputError until a strategy is set), the v3 prompt convention (a system text ending in
`<|endofprompt|>`) and voice cloning (speech_tokenizer_v3.onnx).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import CheckpointError
from engine.families.base import ModelFamily, ModuleConfigs, register, registered_voices_only
from engine.families.cosyvoice2 import INSTRUCT2, qwen_tokenizer
from engine.flow_v3 import CausalMaskedDiffWithDiT, DiTFlowConfig
from engine.frontend import ENDOFPROMPT
from engine.hift_v3 import CausalHiFTConfig, CausalHiFTGenerator
from engine.llm_v3 import ENDOFPROMPT_TOKEN, CosyVoice3LM, CosyVoice3LMConfig, CosyVoice3TextEmbedding
from engine.qwen2_llm import QWEN_DIR
from engine.qwen_tokenizer import COSYVOICE3_SPECIAL_TOKENS, QWEN2_ENDOFTEXT_ID, QwenTokenizer


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
        voice_rules=INSTRUCT2,  # the v3 prompt convention (system text ending in <|endofprompt|>) goes here
        instruction_support=registered_voices_only,
        streaming=None,  # the v3 streaming strategy (an engine.streaming.ChunkStrategy) goes here
        cloning=None,  # the v3 cloning models (speech_tokenizer_v3.onnx, 25 Hz, 24 kHz prompt mel) go here
    )
)
