"""spk2info.pt speakers: SFT entries ({'embedding'}) and the zero-shot entries of official `add_zero_shot_spk`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import CheckpointError
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import load_model
from engine.runtime.pipeline import CosyVoice
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.speaker_bank import VoiceBank

SHORT = SamplingOptions(seed=3, min_token_text_ratio=2, max_token_text_ratio=4)


def zero_shot_entry(text_tokens: int = 5, speech_tokens: int = 10, frames: int = 20, seed: int = 0) -> dict:
    """An entry laid out as official `add_zero_shot_spk` stores it: the zero-shot model input without the text."""
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.randn(1, 192, generator=generator)
    tokens = torch.randint(0, 96, (1, speech_tokens), dtype=torch.int32, generator=generator)

    def length(n: int) -> torch.Tensor:
        return torch.tensor([n], dtype=torch.int32)

    return {
        "prompt_text": torch.randint(0, 200, (1, text_tokens), dtype=torch.int32, generator=generator),
        "prompt_text_len": length(text_tokens),
        "llm_prompt_speech_token": tokens,
        "llm_prompt_speech_token_len": length(speech_tokens),
        "flow_prompt_speech_token": tokens.clone(),
        "flow_prompt_speech_token_len": length(speech_tokens),
        "prompt_speech_feat": torch.randn(1, frames, 80, generator=generator),
        "prompt_speech_feat_len": length(frames),
        "llm_embedding": embedding,
        "flow_embedding": embedding.clone(),
    }


def write_spk2info(path: Path, entries: dict) -> Path:
    torch.save(entries, path)
    return path


def test_sft_and_zero_shot_speakers_load_side_by_side(tmp_path: Path) -> None:
    entry = zero_shot_entry()
    sft = torch.randn(1, 192)
    bank = VoiceBank.from_spk2info(
        write_spk2info(tmp_path / "spk2info.pt", {"sft": {"embedding": sft}, "mine": entry}), 192
    )
    assert bank.names == ["mine", "sft"]
    assert bank.stored_prompt("sft") is None
    torch.testing.assert_close(bank.embedding("sft"), sft[0])
    stored = bank.stored_prompt("mine")
    assert stored.prompt_text_tokens == entry["prompt_text"][0].tolist()
    np.testing.assert_array_equal(stored.llm_speech_tokens, entry["llm_prompt_speech_token"][0].numpy())
    assert stored.llm_speech_tokens.dtype == np.int64 and stored.speech_feat.shape == (20, 80)
    np.testing.assert_array_equal(stored.flow_embedding, entry["flow_embedding"][0].numpy())
    np.testing.assert_array_equal(bank.embedding("mine").numpy(), stored.flow_embedding)


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda e: e.pop("prompt_speech_feat"), "prompt_speech_feat"),
        (lambda e: e.update(llm_embedding=torch.zeros(1, 7)), "llm_embedding"),
        (lambda e: e.update(prompt_text=torch.zeros(1, 3)), "integer"),
        (lambda e: e.update(prompt_speech_feat=torch.zeros(1, 0, 80)), "no prompt mel"),
    ],
)
def test_a_malformed_zero_shot_speaker_is_refused_by_name(tmp_path: Path, damage, needle: str) -> None:
    entry = zero_shot_entry()
    damage(entry)
    with pytest.raises(CheckpointError, match=needle) as error:
        VoiceBank.from_spk2info(write_spk2info(tmp_path / "spk2info.pt", {"broken": entry}), 192)
    assert "'broken'" in str(error.value)


def test_a_model_dir_with_a_zero_shot_speaker_loads(conformance_kit: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("cosyvoice.yaml", "llm.pt", "flow.pt", "hift.pt"):
        (model / name).symlink_to(conformance_kit / "model" / name)
    shipped = torch.load(conformance_kit / "model" / "spk2info.pt", weights_only=True)
    write_spk2info(model / "spk2info.pt", {**shipped, "zero_shot_a": zero_shot_entry()})
    loaded = load_model(model, components=("encoder",))
    assert loaded.voices.names == sorted([*shipped, "zero_shot_a"])
    assert loaded.voices.stored_prompt("zero_shot_a") is not None


@pytest.fixture(scope="module", params=["tiny", "cosyvoice2-tiny"])
def tts(request: pytest.FixtureRequest) -> CosyVoice:
    return CosyVoice.load(request.param)


def test_a_zero_shot_speaker_speaks_with_its_stored_prompt(tts: CosyVoice, tmp_path: Path) -> None:
    entry = zero_shot_entry()
    model = tts.encoder.model
    bank = VoiceBank.from_spk2info(
        write_spk2info(tmp_path / "spk2info.pt", {"mine": entry, "sft": {"embedding": torch.randn(1, 192)}}), 192
    )
    original, model.voices = model.voices, bank
    try:
        request = SynthesisRequest("Stored voices speak.", "mine", sampling=SHORT)
        [segment] = tts.encoder.encode(request)
        [plain] = tts.encoder.encode(replace(request, voice="sft"))
        [cross] = tts.encoder.encode(replace(request, cross_lingual=True))
    finally:
        model.voices = original
    prompt_text = entry["prompt_text"].shape[1]
    assert len(segment.text_encoded) == len(plain.text_encoded) + prompt_text  # the stored prompt text leads
    assert segment.text_len == plain.text_len
    np.testing.assert_array_equal(segment.llm_prompt_speech_tokens, entry["llm_prompt_speech_token"][0].numpy())
    np.testing.assert_array_equal(segment.flow_prompt_speech_tokens, entry["flow_prompt_speech_token"][0].numpy())
    np.testing.assert_array_equal(segment.prompt_feat, entry["prompt_speech_feat"][0].numpy())
    np.testing.assert_array_equal(segment.llm_embedding, entry["llm_embedding"][0].numpy())
    # cross-lingual keeps the voice in the flow only (official frontend_cross_lingual with zero_shot_spk_id)
    assert len(cross.text_encoded) == len(plain.text_encoded) and len(cross.llm_prompt_speech_tokens) == 0
    np.testing.assert_array_equal(cross.prompt_feat, segment.prompt_feat)
    [audio] = tts.decoder.decode_batch([segment])
    assert np.isfinite(audio).all() and len(audio) > 0
