"""An LLM may pick a stop id at its first step (random weights do, and so may a real model): that sentence is
silence, on the whole and the streaming paths, and the sentences batched with it are decoded as alone."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import engine.llm.generation
from engine.llm.sampling import SamplingOptions
from engine.runtime.pipeline import CosyVoice
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import SynthesisRequest

SILENT_SEED, SPOKEN_SEED = 7, 3


@pytest.fixture(scope="module", params=["tiny", "cosyvoice2-tiny", "cosyvoice3-tiny"])
def tts(request: pytest.FixtureRequest) -> CosyVoice:
    return CosyVoice.load(request.param)


@pytest.fixture
def silent_seed_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sentence sampled with SILENT_SEED draws the last class (a stop id in every family) at its first step."""
    sample: Callable = engine.llm.generation.sample_token

    def sample_or_stop(scores, tokens, options, generator) -> int:
        return scores.shape[-1] - 1 if options.seed == SILENT_SEED else sample(scores, tokens, options, generator)

    monkeypatch.setattr(engine.llm.generation, "sample_token", sample_or_stop)


def encoded(tts: CosyVoice, seed: int) -> EncodedSegment:
    [segment] = tts.encoder.encode(SynthesisRequest("Hello there.", tts.voices[0], sampling=SamplingOptions(seed=seed)))
    return segment


def streamed(tts: CosyVoice, segments: list[EncodedSegment]) -> list[np.ndarray]:
    chunks: list[list[np.ndarray]] = [[] for _ in segments]
    for step in tts.decoder.open_stream(segments):
        for row, out in enumerate(step):
            assert not isinstance(out, Exception), out
            if out is not None:
                chunks[row].append(out)
    return [np.concatenate(c) if c else np.zeros(0, dtype=np.float32) for c in chunks]


def test_whole_a_sentence_stopping_at_once_is_empty_audio(tts: CosyVoice, silent_seed_stops: None) -> None:
    spoken = encoded(tts, SPOKEN_SEED)
    [alone] = tts.decoder.decode_batch([spoken])
    silent, batched = tts.decoder.decode_batch([encoded(tts, SILENT_SEED), spoken])
    assert silent.dtype == np.float32 and silent.shape == (0,)
    assert alone.size and np.isfinite(alone).all()
    np.testing.assert_allclose(batched, alone, atol=1e-4, rtol=0)


def test_streamed_a_sentence_stopping_at_once_is_empty_audio(tts: CosyVoice, silent_seed_stops: None) -> None:
    spoken = encoded(tts, SPOKEN_SEED)
    [alone] = streamed(tts, [spoken])
    silent, batched = streamed(tts, [encoded(tts, SILENT_SEED), spoken])
    assert silent.shape == (0,)
    assert alone.size and np.isfinite(alone).all()
    np.testing.assert_allclose(batched, alone, atol=1e-4, rtol=0)
