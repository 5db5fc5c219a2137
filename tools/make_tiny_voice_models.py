"""Tiny stand-ins for the official voice-cloning ONNX models, with their input/output names and shapes.

The tiny presets ship the files this tool writes (`engine/loading/presets/voice_models/<preset>/`), so a server on a
tiny model can clone voices with no download: serving reads the shipped files with onnxruntime and never runs this.
`python -m tools.make_tiny_voice_models`, from the repository root, regenerates them (it needs the `onnx` package of
the `test` extra); the tests write the same models for their own cloners.

* `campplus.onnx`: float [1, T, 80] -> float [1, 192]: mean of the squared (mean-removed) fbank over time, then a
  fixed projection, so the embedding depends on how each band varies in the recording;
* the family's speech tokenizer (`speech_tokenizer_v1.onnx`, `_v2.onnx`, `_v3.onnx`): `feats` float [1, 128, T]
  and `feats_length` int32 [1] -> `indices` int64 [1, T'], T' = T // 2 (v1, 50 tokens/s) or T // 4 (v2 and v3,
  25 tokens/s): average pooling over time, a fixed projection onto the whole vocabulary, argmax.

Weights come from a fixed seed, so every call writes identical models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engine.families.base import ModelConfig
from engine.loading.loader import PRESET_VOICE_MODELS, PRESETS, PRESETS_DIR
from engine.voices.spec import CloningModels

_OPSET = 17
_IR_VERSION = 8  # the IR version of opset 17, readable by any onnxruntime that runs opset 17
_FBANK_BINS = 80
_EMBEDDING_DIM = 192
_WHISPER_MELS = 128
_LOG_MEL_RATE = 100  # log-mel frames per second


def _save(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)], producer_name="cosyvoice-serve")
    model.ir_version = _IR_VERSION
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def _campplus_graph(rng: np.random.Generator) -> onnx.GraphProto:
    projection = (rng.standard_normal((_FBANK_BINS, _EMBEDDING_DIM)) / np.sqrt(_FBANK_BINS)).astype(np.float32)
    nodes = [
        helper.make_node("Mul", ["input", "input"], ["squared"]),
        helper.make_node("ReduceMean", ["squared"], ["band_power"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["band_power", "projection"], ["output"]),
    ]
    return helper.make_graph(
        nodes,
        "tiny_campplus",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "frames", _FBANK_BINS])],
        outputs=[helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, _EMBEDDING_DIM])],
        initializer=[numpy_helper.from_array(projection, "projection")],
    )


def _speech_tokenizer_graph(rng: np.random.Generator, models: CloningModels, vocabulary: int) -> onnx.GraphProto:
    stride = _LOG_MEL_RATE // models.token_rate
    projection = rng.standard_normal((_WHISPER_MELS, vocabulary)).astype(np.float32)
    nodes = [
        helper.make_node("AveragePool", ["feats"], ["pooled"], kernel_shape=[stride], strides=[stride]),
        helper.make_node("Transpose", ["pooled"], ["frames_first"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["frames_first", "projection"], ["logits"]),
        helper.make_node("ArgMax", ["logits"], ["indices"], axis=2, keepdims=0),
    ]
    return helper.make_graph(
        nodes,
        f"tiny_speech_tokenizer_v{models.version}",
        inputs=[
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, _WHISPER_MELS, "frames"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        outputs=[helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "tokens"])],
        initializer=[numpy_helper.from_array(projection, "projection")],
    )


def write_tiny_voice_models(directory: Path, models: CloningModels, vocabulary: int | None = None) -> None:
    """Write `campplus.onnx` and the family's speech tokenizer (`models.speech_tokenizer_file`) into `directory`;
    the tokens span `vocabulary` ids (default: the family's official speech vocabulary)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7000 + models.version)
    _save(_campplus_graph(rng), directory / "campplus.onnx")
    vocabulary = models.speech_vocab_size if vocabulary is None else vocabulary
    _save(_speech_tokenizer_graph(rng, models, vocabulary), directory / models.speech_tokenizer_file)


def write_preset_voice_models() -> None:
    """(Re)write the cloning models shipped with the presets, each tokenizer over its preset's speech vocabulary."""
    written: set[Path] = set()
    for preset, directory in PRESET_VOICE_MODELS.items():
        if directory in written:
            continue
        config = ModelConfig.from_yaml_file(PRESETS_DIR / PRESETS[preset])
        write_tiny_voice_models(directory, config.family.cloning_models(), config.flow.vocab_size)
        written.add(directory)
        print(f"wrote {directory}")


if __name__ == "__main__":
    write_preset_voice_models()
