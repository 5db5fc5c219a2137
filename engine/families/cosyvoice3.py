"""CosyVoice3 (Fun-CosyVoice3-0.5B): `CosyVoice3LM`, the DiT flow, the causal HiFT at 24 kHz.

Built so far: loading, whole-utterance synthesis with the CosyVoice2 tokenizer and instruct2 rules, streaming
(the CosyVoice2 chunks with the causal vocoder re-run, `CausalPrefixRerunChunks`) and the official silent-token
filter. Not built yet, each with its place below: the v3 prompt convention (a system text ending in
`<|endofprompt|>`) and voice cloning (speech_tokenizer_v3.onnx).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.families.base import ModelFamily, ModuleConfigs, register, registered_voices_only
from engine.families.cosyvoice2 import INSTRUCT2, qwen_tokenizer
from engine.flow_v3 import CausalMaskedDiffWithDiT, DiTFlowConfig
from engine.hift_v3 import CausalHiFTConfig, CausalHiFTGenerator
from engine.llm_v3 import CosyVoice3LM, CosyVoice3LMConfig, CosyVoice3TextEmbedding
from engine.streaming import CausalPrefixRerunChunks

# The official CosyVoice3Model.silent_tokens: FSQ codes of silence and breath in the 6561-token codebook
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})


def _read_configs(tree: dict[str, Any], model_dir: Path) -> ModuleConfigs:
    return ModuleConfigs(
        llm=CosyVoice3LMConfig.from_yaml(tree["llm"], model_dir),
        flow=DiTFlowConfig.from_yaml(tree["flow"]),
        hift=CausalHiFTConfig.from_yaml(tree["hift"]),
    )


COSYVOICE3 = register(
    ModelFamily(
        name="CosyVoice3",
        version=3,
        config_file="cosyvoice3.yaml",
        llm_class="CosyVoice3LM",
        read_configs=_read_configs,
        modules={"llm": CosyVoice3LM, "flow": CausalMaskedDiffWithDiT, "hift": CausalHiFTGenerator},
        text_module=CosyVoice3TextEmbedding,
        tokenizer=qwen_tokenizer,  # the v3 tokenizer (CosyVoice3's added special tokens) goes here
        voice_rules=INSTRUCT2,  # the v3 prompt convention (system text ending in <|endofprompt|>) goes here
        instruction_support=registered_voices_only,
        streaming=CausalPrefixRerunChunks,
        cloning=None,  # the v3 cloning models (speech_tokenizer_v3.onnx, 25 Hz, 24 kHz prompt mel) go here
        silent_tokens=SILENT_TOKENS,
    )
)
