"""CosyVoice2 model directories through the loader and the two stages: the v2 kit with a tiny Qwen2 tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import CheckpointError
from engine.families.base import ModelConfig
from engine.flow.causal import CausalMaskedDiffWithXvec
from engine.llm.qwen2_lm import QWEN_DIR, Qwen2LM, Qwen2TextEmbedding
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import load_model, load_module
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.memory import estimate_request_memory
from engine.runtime.pipeline import CosyVoice
from engine.runtime.synthesis_request import SynthesisRequest
from tests.engine.conftest import write_tiny_qwen_tokenizer

SHORT = SamplingOptions(seed=2, min_token_text_ratio=2, max_token_text_ratio=4)


@pytest.fixture(scope="module")
def v2_model_dir(v2_kit: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kit's model dir plus the tiny Qwen2 tokenizer files an official CosyVoice-BlankEN dir has."""
    model_dir = tmp_path_factory.mktemp("cosyvoice2") / "model"
    shutil.copytree(v2_kit / "model", model_dir)
    write_tiny_qwen_tokenizer(model_dir / QWEN_DIR)
    return model_dir


def test_the_yaml_name_and_llm_class_make_it_a_v2_model(v2_kit: Path) -> None:
    model = load_model(v2_kit / "model", components=("decoder",))
    assert model.config.version == 2 and model.config.sample_rate == 24000
    assert isinstance(model.llm, Qwen2LM) and isinstance(model.flow, CausalMaskedDiffWithXvec)
    assert {"spk2_female_a", "spk2_male_b"} <= set(model.voices.names)
    assert isinstance(load_module(v2_kit / "model", "flow"), CausalMaskedDiffWithXvec)


def test_the_encoder_needs_the_tokenizer_files(v2_kit: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    (model_dir / QWEN_DIR).mkdir(parents=True)
    for name in ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", f"{QWEN_DIR}/config.json"):
        (model_dir / name).symlink_to(v2_kit / "model" / name)
    with pytest.raises(CheckpointError, match="tokenizer"):  # a CosyVoice-BlankEN with the Qwen2 config only
        load_model(model_dir, components=("encoder",))


def test_a_dir_with_both_yamls_is_refused(tmp_path: Path, v2_kit: Path) -> None:
    for name in ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt"):
        (tmp_path / name).symlink_to(v2_kit / "model" / name)
    (tmp_path / "cosyvoice.yaml").write_text("sample_rate: 22050\n")
    with pytest.raises(CheckpointError, match="both"):
        load_model(tmp_path)


def test_synthesis_from_an_official_v2_dir(v2_model_dir: Path) -> None:
    tts = CosyVoice.load(v2_model_dir)
    assert tts.sample_rate == 24000
    audio, rate = tts.synthesize("Hello from version two.", "spk2_female_a", seed=3, max_token_text_ratio=4)
    assert rate == 24000 and audio.dtype == np.float32 and np.isfinite(audio).all()
    assert len(audio) > 0 and len(audio) % (2 * 480) == 0  # 2 mel frames of 480 samples per speech token


def test_v2_segments_in_a_batch_equal_segments_alone(v2_model_dir: Path) -> None:
    """Each stage within 1e-4 of the segment alone; the waveform end to end within 5e-4, because the 24 kHz
    HiFT amplifies the flow's fp32 rounding differences (the kit's own tolerance for v2 speech)."""
    tts = CosyVoice.load(v2_model_dir)
    decoder, encoder = tts.decoder, tts.encoder
    texts = ["Short.", "A longer sentence than the first one, with more words."]
    segments = [encoder.encode(SynthesisRequest(t, "spk2_male_b", sampling=SHORT))[0] for t in texts]
    tokens = decoder.generate_tokens(segments)
    mels = decoder.tokens_to_mel(segments, tokens)
    waves = decoder.vocode(segments, mels)
    together = decoder.decode_batch(segments)
    for index, segment in enumerate(segments):
        [alone_tokens] = decoder.generate_tokens([segment])
        assert torch.equal(tokens[index], alone_tokens)
        [alone_mel] = decoder.tokens_to_mel([segment], [alone_tokens])
        torch.testing.assert_close(mels[index], alone_mel, atol=1e-4, rtol=0)
        [same_mel_wave] = decoder.vocode([segment], [mels[index]])
        np.testing.assert_allclose(waves[index], same_mel_wave, atol=1e-4)
        [alone] = decoder.decode_batch([segment])
        assert together[index].shape == alone.shape
        np.testing.assert_allclose(together[index], alone, atol=5e-4)


def test_fp16_v2_decoder_weights_are_half_and_finite(v2_model_dir: Path) -> None:
    decoder = load_model(v2_model_dir, dtype="float16", components=("decoder",))
    for module in (decoder.llm, decoder.flow, decoder.hift):
        assert {p.dtype for p in module.parameters()} == {torch.float16}
    encoder = CosyVoice.load(v2_model_dir).encoder
    segments = encoder.encode(SynthesisRequest("Half precision.", "spk2_female_a", sampling=SHORT))
    [audio] = CosyVoice(decoder).decoder.decode_batch(segments)
    assert isinstance(audio, np.ndarray) and np.isfinite(audio).all() and len(audio) > 0


def test_v2_memory_estimate_counts_only_the_key_value_heads(v2_kit: Path) -> None:
    config = ModelConfig.from_yaml_file(v2_kit / "model" / "cosyvoice2.yaml")
    small, large = estimate_request_memory(config, 10), estimate_request_memory(config, 20)
    qwen = config.llm.qwen
    per_position = 2 * qwen.num_hidden_layers * qwen.num_key_value_heads * qwen.head_dim * 2
    assert large.kv_cache_bytes - small.kv_cache_bytes == per_position * (10 + 10 * 20)  # text + max speech


def test_a_v2_encoder_replica_keeps_only_the_token_embedding() -> None:
    encoder = load_model("cosyvoice2-tiny", components=("encoder",))
    assert isinstance(encoder.text_llm, Qwen2TextEmbedding)
    qwen = encoder.config.llm.qwen
    assert sum(p.numel() for p in encoder.text_llm.parameters()) == qwen.vocab_size * qwen.hidden_size
    both = load_model("cosyvoice2-tiny")  # one process: the encoder shares the decoder LLM's table
    assert both.text_llm.embed_tokens is both.llm.llm.model.model.embed_tokens
    request = SynthesisRequest("Same text, same encoding.", both.voices.names[0], sampling=SHORT)
    [alone], [shared] = TextEncoderStage(encoder).encode(request), TextEncoderStage(both).encode(request)
    np.testing.assert_array_equal(alone.text_encoded, shared.text_encoded)
