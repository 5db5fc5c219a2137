"""Model families as plug-ins: one module per CosyVoice generation, each registering its `ModelFamily`.

The one place that knows which stage classes make a version; above the stages, below the loader and the runtime.
`chunking` holds each family's streaming `ChunkStrategy`; `base` the registry and `ModelConfig`.

See `engine.families.base` for what a family names; `cosyvoice1`, `cosyvoice2` and `cosyvoice3` register theirs
when this package is imported.
"""

from engine.families import cosyvoice1, cosyvoice2, cosyvoice3
from engine.families.base import (
    MODULE_NAMES,
    InstructionSupport,
    ModelConfig,
    ModelFamily,
    ModuleConfigs,
    VoiceRules,
    families,
    family_for_config_file,
    family_for_llm_class,
    models_following_instructions,
    register,
)

COSYVOICE1, COSYVOICE2, COSYVOICE3 = cosyvoice1.COSYVOICE1, cosyvoice2.COSYVOICE2, cosyvoice3.COSYVOICE3

__all__ = [
    "COSYVOICE1",
    "COSYVOICE2",
    "COSYVOICE3",
    "MODULE_NAMES",
    "InstructionSupport",
    "ModelConfig",
    "ModelFamily",
    "ModuleConfigs",
    "VoiceRules",
    "families",
    "family_for_config_file",
    "family_for_llm_class",
    "models_following_instructions",
    "register",
]
