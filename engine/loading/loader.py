"""Build the model from an official model directory, or from a preset with seeded dummy weights.

Load formats (like vLLM's `--load-format`):
- `official`: a CosyVoice v1 model dir (`cosyvoice.yaml`, `llm.pt`, `flow.pt`, `hift.pt`, optional `spk2info.pt`)
  or a CosyVoice2 / CosyVoice3 one (`cosyvoice2.yaml` / `cosyvoice3.yaml`, the same checkpoints, and
  `CosyVoice-BlankEN/` with the Qwen2 config and tokenizer), every checkpoint loaded strictly with
  `weights_only=True`; or a hub id of one, resolved into its hub's cache (`engine.loading.model_source`). The LLM's
  checkpoint is `llm_checkpoint`'s pick (`auto`: the RL-tuned `llm.rl.pt` where the model has one);
- `dummy`: the real architecture from a preset (`cosyvoice-300m`, `tiny`, `cosyvoice2-0.5b`, `cosyvoice2-tiny`,
  `cosyvoice3-0.5b`, `cosyvoice3-tiny`) or a yaml file, seeded random weights (a v2/v3 dummy model gets a
  byte-level stand-in for the Qwen2 tokenizer).
The yaml's LLM class picks the model family (`engine.families`), which names the config readers, module classes,
encoder-side text module and tokenizer used here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from engine.errors import CheckpointError
from engine.families import MODULE_NAMES, ModelConfig, families
from engine.loading.checkpoint import load_strict, read_state_dict
from engine.loading.model_source import (
    LLM_CHECKPOINT_AUTO,
    OFFICIAL_LLM_CHECKPOINT,
    llm_checkpoint_file,
    model_directory,
    served_name,
)
from engine.nn.precision import (
    QUANTIZED_WEIGHT_BYTES,
    DecoderDtypes,
    decoder_dtypes,
    module_sizes,
    pack_linear_for_cpu,
    quantize_linear_int4,
    quantize_linear_int8,
)
from engine.text.frontend import TextFrontend
from engine.text.languages import SPELLED_OUT_LANGUAGES
from engine.vocoder.hift import HiFTGenerator, upgrade_legacy_weight_norm
from engine.voices.speaker_bank import VoiceBank

PRESETS_DIR = Path(__file__).parent / "presets"
PRESETS = {
    "dummy": "cosyvoice-300m.yaml",
    "cosyvoice-300m": "cosyvoice-300m.yaml",
    "tiny": "tiny.yaml",
    "cosyvoice2-0.5b": "cosyvoice2-0.5b/cosyvoice2.yaml",
    "cosyvoice2-tiny": "cosyvoice2-tiny/cosyvoice2.yaml",
    "cosyvoice3-0.5b": "cosyvoice3-0.5b/cosyvoice3.yaml",
    "cosyvoice3-tiny": "cosyvoice3-tiny/cosyvoice3.yaml",
}
# The tiny cloning models shipped for presets (written by tools/make_tiny_voice_models.py): campplus.onnx and the
# speech tokenizer of the preset's version, over the preset's speech vocabulary.
PRESET_VOICE_MODELS_DIR = PRESETS_DIR / "voice_models"
PRESET_VOICE_MODELS = {
    "tiny": PRESET_VOICE_MODELS_DIR / "tiny",
    "dummy": PRESET_VOICE_MODELS_DIR / "tiny",  # the same version and speech vocabulary as tiny
    "cosyvoice-300m": PRESET_VOICE_MODELS_DIR / "tiny",
    "cosyvoice2-tiny": PRESET_VOICE_MODELS_DIR / "cosyvoice2-tiny",
    "cosyvoice3-tiny": PRESET_VOICE_MODELS_DIR / "cosyvoice3-tiny",
}
CHECKPOINT_FILES = tuple(f"{name}.pt" for name in MODULE_NAMES)  # the official names; llm_checkpoint may pick another
COMPONENTS = ("encoder", "decoder")


@dataclass
class LoadedModel:
    """What the stages need. `text_llm` encodes text on CPU; `llm`, `flow`, `hift` decode on `decoder_device`."""

    name: str
    config: ModelConfig
    frontend: TextFrontend | None
    voices: VoiceBank
    text_llm: nn.Module | None  # the family's text module (engine.families)
    llm: nn.Module | None
    flow: nn.Module | None
    hift: nn.Module | None
    dtype: torch.dtype  # the LLM's and the flow's (the vocoder's may differ: see engine.nn.precision.decoder_dtypes)
    decoder_device: torch.device
    text_device: torch.device
    precision: DecoderDtypes | None = None  # each decoder module's precision, and why (`auto`)
    llm_checkpoint: str | None = None  # the LLM's checkpoint file of an official model dir (None: dummy weights)


def locate_model(
    source: str | Path, load_format: str | None, llm_checkpoint: str = LLM_CHECKPOINT_AUTO
) -> tuple[str, Path, str | None]:
    """-> (format, path, LLM checkpoint file): the yaml of a preset / dummy file (no checkpoint), or the config of an
    official model directory (a hub id's resolved in its cache) with the LLM checkpoint `llm_checkpoint` picks."""
    text = str(source)
    if load_format in (None, "dummy") and text in PRESETS:
        return "dummy", PRESETS_DIR / PRESETS[text], None
    path = Path(source)
    if load_format == "dummy" or (load_format is None and path.suffix in (".yaml", ".yml")):
        if not path.is_file():
            raise CheckpointError(f"dummy model config {path} not found (presets: {', '.join(PRESETS)})")
        return "dummy", path, None
    if load_format not in (None, "official"):
        raise CheckpointError(f"unknown load format {load_format!r}; use 'official' or 'dummy'")
    path = model_directory(text)
    config = family_config_file(path)
    llm_file = llm_checkpoint_file(path, llm_checkpoint)
    missing = [name for name in (llm_file, "flow.pt", "hift.pt") if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"model directory {path} is missing {', '.join(missing)}")
    return "official", config, llm_file


def family_config_file(path: Path) -> Path:
    """The one family config (cosyvoice.yaml, cosyvoice2.yaml, ...) of an official model directory."""
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} not found (or use one of the presets: {', '.join(PRESETS)})")
    configs = [path / family.config_file for family in families() if (path / family.config_file).is_file()]
    if len(configs) != 1:
        expected = ", ".join(f"{family.config_file} ({family.name})" for family in families())
        found = ", ".join(config.name for config in configs) or "none"
        raise CheckpointError(f"model directory {path} must hold exactly one of {expected}; it holds {found}")
    return configs[0]


@dataclass(frozen=True)
class ModelSizes:
    """What a deployment plan needs of a model: its config (each module's shapes, the per-request memory estimates)
    and each decoder module's parameter count (`parameters`: all weights; `gemm`: those of its Linear and
    convolution layers, which `auto`'s CPU choice weighs)."""

    config: ModelConfig
    parameters: dict[str, int]
    gemm: dict[str, int]

    def weight_bytes(self, dtypes: DecoderDtypes) -> int:
        """The decoder modules' weights cast to `dtypes` (an INT8 LLM's Linear weights at a byte each, an INT4 one's at
        half a byte and its scales)."""
        llm_bytes = QUANTIZED_WEIGHT_BYTES.get(dtypes.llm_quantization, dtypes.llm.itemsize)
        return (
            int(self.parameters["llm"] * llm_bytes)
            + self.parameters["flow"] * dtypes.flow.itemsize
            + self.parameters["hift"] * dtypes.hift.itemsize
        )


def model_sizes(source: str) -> ModelSizes:
    """The sizes of a preset, a model dir or a hub id (of which only the configs are fetched), from its modules built
    on the meta device: no weights are read or allocated."""
    text = str(source)
    config_path = PRESETS_DIR / PRESETS[text] if text in PRESETS else family_config_file(model_directory(text, True))
    config = ModelConfig.from_yaml_file(config_path)
    with torch.device("meta"):
        modules = {name: config.family.modules[name](getattr(config, name)) for name in MODULE_NAMES}
    parameters = {name: sum(p.numel() for p in module.parameters()) for name, module in modules.items()}
    return ModelSizes(config, parameters, module_sizes(modules["llm"], modules["flow"], modules["hift"]))


def _build(module: nn.Module, model_dir: Path | None, file_name: str) -> nn.Module:
    """Load the official checkpoint into `module` (strictly), or keep its seeded random init (dummy)."""
    if model_dir is not None:
        path = model_dir / file_name
        # Files saved with the legacy torch.nn.utils.weight_norm carry weight_g / weight_v keys.
        load_strict(module, upgrade_legacy_weight_norm(read_state_dict(path)), path)
    if isinstance(module, HiFTGenerator):
        module.fold_weight_norm()  # loaded for inference only: the weight norm is not recomputed on every call
    return module.eval().requires_grad_(False)


def load_module(model_dir: str | Path, name: str) -> nn.Module:
    """One official module ("llm", "flow" or "hift") of a model dir, strictly loaded, in eval mode."""
    if name not in MODULE_NAMES:
        raise CheckpointError(f"unknown module {name!r}; use one of {MODULE_NAMES}")
    _, config_path, _ = locate_model(model_dir, "official", llm_checkpoint=OFFICIAL_LLM_CHECKPOINT)
    config = ModelConfig.from_yaml_file(config_path)
    return _build(config.family.modules[name](getattr(config, name)), config_path.parent, f"{name}.pt")


def _text_frontend(
    config: ModelConfig, config_path: Path, load_format: str, max_text_chars: int, spell_out_languages: bool
) -> TextFrontend:
    """The front end of a located model: its family's tokenizer and, where `spell_out_languages`, number spelling in
    the family's languages beyond Chinese and English (CosyVoice3: de, es, fr, it, ru, ja, ko; v1, v2: ja, ko)."""
    tokenizer = config.family.tokenizer(config, config_path, load_format == "official")
    spelled = [language for language in config.family.languages if language in SPELLED_OUT_LANGUAGES]
    return TextFrontend(
        max_text_chars, tokenizer=tokenizer, spelled_out_languages=spelled if spell_out_languages else ()
    )


def load_frontend(
    source: str | Path = "tiny",
    *,
    load_format: str | None = None,
    max_text_chars: int = 2000,
    spell_out_languages: bool = True,
) -> TextFrontend:
    """The text front end of a model (a preset, a model dir or a hub id) alone, none of its weights loaded: what
    `load_model`'s encoder normalises with (`cosyvoice-serve normalize`)."""
    fmt, config_path, _ = locate_model(source, load_format, LLM_CHECKPOINT_AUTO)
    config = ModelConfig.from_yaml_file(config_path)
    return _text_frontend(config, config_path, fmt, max_text_chars, spell_out_languages)


def load_model(
    source: str | Path = "tiny",
    *,
    load_format: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    int8: bool = False,
    components: tuple[str, ...] = COMPONENTS,
    seed: int = 0,
    max_text_chars: int = 2000,
    cpu_packing: bool = True,
    llm_checkpoint: str = LLM_CHECKPOINT_AUTO,
    spell_out_languages: bool = True,
) -> LoadedModel:
    """Load a model for the given stage `components` ("encoder": frontend + text encoder, "decoder").

    `dtype` casts the decoder weights (float32 / float16 / bfloat16: real low-precision weights; `auto`: each
    module's dtype chosen for the family and device, `engine.nn.precision.decoder_dtypes`);
    the text encoder always runs in float32 on CPU, INT8-quantized when `int8` (then a CPU float32
    decoder LLM is quantized too). `cpu_packing` packs the float32 CPU LLM's Linear weights for oneDNN (faster
    batched decode steps); turn it off to keep plain `nn.Linear` weights for casts, copies or state dicts.
    `llm_checkpoint`: the LLM's checkpoint in an official model dir, `auto` (`llm.rl.pt` where the model has it, else
    `llm.pt`) or a file name (`engine.loading.model_source.llm_checkpoint_file`). `spell_out_languages`: the front
    end spells out numbers in the family's languages beyond Chinese and English (`_text_frontend`).
    """
    unknown = set(components) - set(COMPONENTS)
    if unknown or not components:
        raise CheckpointError(f"components must be among {COMPONENTS}, got {components}")
    fmt, config_path, llm_file = locate_model(source, load_format, llm_checkpoint)
    config = ModelConfig.from_yaml_file(config_path)
    model_dir = config_path.parent if fmt == "official" else None
    decoder_device = torch.device(device)
    cpu = torch.device("cpu")

    classes = config.family.modules
    decoding = "decoder" in components
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        llm = _build(classes["llm"](config.llm), model_dir, llm_file or OFFICIAL_LLM_CHECKPOINT)
        flow = _build(classes["flow"](config.flow), model_dir, "flow.pt") if decoding else None
        hift = _build(classes["hift"](config.hift), model_dir, "hift.pt") if decoding else None
    # `auto` on CPU weighs each module's size (engine.nn.precision.cpu_auto_choice)
    sizes = module_sizes(llm, flow, hift) if decoding else None
    dtypes = decoder_dtypes(dtype, config.family.prefers_bfloat16, decoder_device, sizes)
    torch_dtype = dtypes.llm
    # The decoder LLM's quantization: chosen by `auto` / `auto-int4` (the decoder's alone), else INT8 when `int8` asks
    # for it (with the text encoder); float32 CPU layers only
    on_cpu_in_float32 = decoder_device == cpu and torch_dtype == torch.float32
    text_quantization = "int8" if int8 else None
    decoder_quantization = (dtypes.llm_quantization or text_quantization) if on_cpu_in_float32 else None

    text_llm = None
    if "encoder" in components:
        # One LLM copy serves both halves unless the decoder runs on another device or dtype.
        text_llm = config.family.text_module(llm)
        # (a decoder LLM quantized otherwise than `int8` asks leaves a text encoder with Linear layers, v1's, apart)
        has_linear = any(isinstance(m, nn.Linear) for m in text_llm.modules())
        quantized_otherwise = decoder_quantization != text_quantization
        separate = decoding and (not on_cpu_in_float32 or (quantized_otherwise and has_linear))
        text_llm = copy.deepcopy(text_llm) if separate else text_llm
        if int8 and (separate or not decoding):
            quantize_linear_int8(text_llm)
        elif cpu_packing and not int8:
            pack_linear_for_cpu(text_llm)
    decoder_llm = None
    if decoding:
        if decoder_quantization == "int4":
            quantize_linear_int4(llm)
        elif decoder_quantization == "int8":
            quantize_linear_int8(llm)
        decoder_llm = llm.to(device=decoder_device, dtype=torch_dtype)
        if cpu_packing and decoder_quantization is None:
            pack_linear_for_cpu(decoder_llm)  # only float32 CPU layers are packed
        flow = flow.to(device=decoder_device, dtype=dtypes.flow)
        hift = hift.to(device=decoder_device, dtype=dtypes.hift)

    spk2info = None if model_dir is None else model_dir / "spk2info.pt"
    if spk2info is not None and spk2info.is_file():
        voices = VoiceBank.from_spk2info(spk2info, config.spk_embed_dim)
    else:
        voices = VoiceBank.dummy(config.spk_embed_dim, seed=seed) if model_dir is None else VoiceBank({})
    return LoadedModel(
        name=str(source) if fmt == "dummy" else served_name(str(source)),
        config=config,
        frontend=_text_frontend(config, config_path, fmt, max_text_chars, spell_out_languages)
        if "encoder" in components
        else None,
        voices=voices,
        text_llm=text_llm,
        llm=decoder_llm,
        flow=flow,
        hift=hift,
        dtype=torch_dtype,
        decoder_device=decoder_device,
        text_device=cpu,
        precision=replace(dtypes, llm_quantization=decoder_quantization) if decoding else None,
        llm_checkpoint=llm_file,
    )
