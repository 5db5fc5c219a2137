"""The loader, the two serving stages and the single-request API, on the tiny dummy model and the kit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import CheckpointError, InvalidInputError, NonFiniteOutputError, UnknownVoiceError
from engine.families.base import ModelConfig
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import PRESETS_DIR, load_model, load_module
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.memory import estimate_request_memory
from engine.runtime.pipeline import CosyVoice
from engine.runtime.synthesis_request import SynthesisRequest

SHORT = SamplingOptions(seed=7, min_token_text_ratio=2, max_token_text_ratio=4)


@pytest.fixture(scope="module")
def tts() -> CosyVoice:
    return CosyVoice.load("tiny")


def test_synthesize_returns_finite_float32_audio_of_the_token_length(tts: CosyVoice) -> None:
    audio, rate = tts.synthesize("Hello world.", tts.voices[0], seed=1, max_token_text_ratio=4)
    assert rate == 22050 and audio.dtype == np.float32 and audio.ndim == 1
    assert np.isfinite(audio).all() and np.abs(audio).max() <= 0.99
    assert len(audio) % 256 == 0 and len(audio) > 0


def test_a_seed_makes_a_request_reproducible(tts: CosyVoice) -> None:
    first, _ = tts.synthesize("Same seed, same audio.", tts.voices[0], seed=5, max_token_text_ratio=4)
    second, _ = tts.synthesize("Same seed, same audio.", tts.voices[0], seed=5, max_token_text_ratio=4)
    other, _ = tts.synthesize("Same seed, same audio.", tts.voices[0], seed=6, max_token_text_ratio=4)
    np.testing.assert_array_equal(first, second)
    assert len(first) != len(other) or not np.array_equal(first, other)


def test_a_segment_in_a_batch_equals_the_segment_alone(tts: CosyVoice) -> None:
    texts = ["A short one.", "A much longer sentence with many more words than the first one."]
    segments = [
        tts.encoder.encode(SynthesisRequest(t, tts.voices[i % 2], sampling=SHORT))[0] for i, t in enumerate(texts)
    ]
    together = tts.decoder.decode_batch(segments)
    for segment, batched in zip(segments, together, strict=True):
        alone = tts.decoder.decode_batch([segment])[0]
        assert batched.shape == alone.shape
        np.testing.assert_allclose(batched, alone, atol=1e-4)


def test_long_text_is_split_into_ordered_segments(tts: CosyVoice) -> None:
    text = " ".join(["This sentence is here to make the paragraph long enough to be split."] * 8)
    segments = tts.encoder.encode(SynthesisRequest(text, tts.voices[0], sampling=SHORT))
    assert len(segments) > 1
    assert [s.segment_index for s in segments] == list(range(len(segments)))
    assert {s.num_segments for s in segments} == {len(segments)}
    assert len({s.sampling.seed for s in segments}) == len(segments)  # each sentence its own draw


def test_a_planned_request_encodes_sentence_by_sentence_as_all_at_once(tts: CosyVoice) -> None:
    text = " ".join(["This sentence is here to make the paragraph long enough to be split."] * 12) + " The end."
    request = SynthesisRequest(text, tts.voices[0], sampling=SHORT)
    plan = tts.encoder.plan(request)
    at_once = tts.encoder.encode(request)
    one_by_one = tts.encoder.encode_planned(plan, 0, 1) + tts.encoder.encode_planned(plan, 1)
    assert plan.num_segments == len(at_once) == len(one_by_one) == 3
    for alone, together in zip(one_by_one, at_once, strict=True):
        assert np.array_equal(alone.text_encoded, together.text_encoded)  # exactly: the audio is the same
        assert (alone.text_len, alone.sampling, alone.segment_index, alone.num_segments) == (
            together.text_len,
            together.sampling,
            together.segment_index,
            together.num_segments,
        )
    for start, stop in ((1, 1), (-1, 2), (2, 4)):
        with pytest.raises(InvalidInputError, match="not a range"):
            tts.encoder.encode_planned(plan, start, stop)


def test_speed_stretches_the_audio(tts: CosyVoice) -> None:
    normal, _ = tts.synthesize("Speed test.", tts.voices[0], seed=2, max_token_text_ratio=4)
    fast, _ = tts.synthesize("Speed test.", tts.voices[0], seed=2, max_token_text_ratio=4, speed=2.0)
    assert abs(len(fast) - len(normal) / 2) <= 256


def test_instruct_text_drops_the_llm_speaker_embedding(tts: CosyVoice) -> None:
    request = SynthesisRequest("Hello.", tts.voices[0], instruct_text="Speak slowly.", sampling=SHORT)
    [segment] = tts.encoder.encode(request)
    plain = tts.encoder.encode(replace(request, instruct_text=None))[0]
    assert segment.llm_embedding is None and segment.flow_embedding is not None
    assert segment.text_encoded.shape[0] > plain.text_encoded.shape[0]  # the instruct tokens come first
    assert segment.text_len == plain.text_len


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"text": "   "}, InvalidInputError, "empty"),
        ({"text": "x" * 3000}, InvalidInputError, "limit"),
        ({"voice": "nobody"}, UnknownVoiceError, "nobody"),
        ({"speed": 4.5}, InvalidInputError, "speed"),
        ({"speed": 0.2}, InvalidInputError, "speed"),
        ({"instruct_text": " "}, InvalidInputError, "instruct_text"),
    ],
)
def test_bad_requests_raise_clear_project_errors(tts: CosyVoice, kwargs: dict, error: type, message: str) -> None:
    request = {"text": "Hello.", "voice": tts.voices[0], **kwargs}
    with pytest.raises(error, match=message) as info:
        tts.encoder.encode(SynthesisRequest(**request))
    assert 400 <= info.value.http_status < 500


def test_nan_output_is_an_error_not_audio(tts: CosyVoice, monkeypatch: pytest.MonkeyPatch) -> None:
    segments = tts.encoder.encode(SynthesisRequest("Hello.", tts.voices[0], sampling=SHORT))
    hift = tts.decoder.model.hift
    monkeypatch.setattr(hift, "inference", lambda mels, seeds: [torch.full((256,), float("nan")) for _ in mels])
    [result] = tts.decoder.decode_batch(segments)
    assert isinstance(result, NonFiniteOutputError) and result.http_status == 500


def test_official_kit_directory_loads_strictly_with_its_voices(conformance_kit: Path) -> None:
    model = load_model(conformance_kit / "model")
    assert "spk_female_a" in model.voices.names
    for name in ("llm", "flow", "hift"):
        assert isinstance(load_module(conformance_kit / "model", name), torch.nn.Module)


def test_model_dir_with_a_missing_file_is_rejected_by_name(tmp_path: Path, conformance_kit: Path) -> None:
    (tmp_path / "cosyvoice.yaml").write_bytes((conformance_kit / "model" / "cosyvoice.yaml").read_bytes())
    (tmp_path / "llm.pt").write_bytes((conformance_kit / "model" / "llm.pt").read_bytes())
    with pytest.raises(CheckpointError, match=r"flow\.pt, hift\.pt"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "absent")


def test_checkpoint_of_another_module_is_rejected_with_key_names(tmp_path: Path, conformance_kit: Path) -> None:
    for name in ("cosyvoice.yaml", "llm.pt", "flow.pt"):
        (tmp_path / name).write_bytes((conformance_kit / "model" / name).read_bytes())
    (tmp_path / "hift.pt").write_bytes((conformance_kit / "model" / "flow.pt").read_bytes())
    with pytest.raises(CheckpointError, match=r"hift\.pt.*missing keys"):
        load_model(tmp_path)


def test_fp16_weights_are_really_half_and_give_finite_audio() -> None:
    model = load_model("tiny", dtype="bfloat16", components=("decoder",))
    for module in (model.llm, model.flow, model.hift):
        assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    encoder = load_model("tiny", components=("encoder",))
    segments = TextEncoderStage(encoder).encode(
        SynthesisRequest("Half precision.", encoder.voices.names[0], sampling=SHORT)
    )
    [audio] = SpeechDecoderStage(model).decode_batch(segments)
    assert isinstance(audio, np.ndarray) and np.isfinite(audio).all() and len(audio) > 0


def test_int8_text_encoder_stays_close_to_fp32() -> None:
    fp32 = load_model("tiny", components=("encoder",))
    int8 = load_model("tiny", components=("encoder",), int8=True)
    request = SynthesisRequest("INT8 quality check on the text encoder.", fp32.voices.names[0], sampling=SHORT)
    a = TextEncoderStage(fp32).encode(request)[0].text_encoded
    b = TextEncoderStage(int8).encode(request)[0].text_encoded
    cosine = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
    assert cosine > 0.99


def test_memory_estimate_grows_with_text() -> None:
    config = ModelConfig.from_yaml_file(PRESETS_DIR / "cosyvoice-300m.yaml")
    small, large = estimate_request_memory(config, 10), estimate_request_memory(config, 60)
    assert 0 < small.total_bytes < large.total_bytes
    assert large.kv_cache_bytes == 6 * small.kv_cache_bytes - 5 * (2 * 14 * 2 * 1024 * 2)  # linear in length


def test_decoder_health_check_runs_a_vocoder_pass_and_raises_its_fault(tts: CosyVoice) -> None:
    stage = tts.decoder
    stage.check_health()

    def device_fault(module: torch.nn.Module, inputs: tuple) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    hook = stage.model.hift.f0_predictor.register_forward_pre_hook(device_fault)  # the first layer run
    try:
        with pytest.raises(RuntimeError, match="CUDA error"):
            stage.check_health()
    finally:
        hook.remove()
    stage.check_health()  # healthy again once the fault is gone
