"""Streaming synthesis on the tiny presets of each family that streams: seams, batching of streams, cancellation;
and CosyVoice v1's chunk timing and total length (CosyVoice2's schedule: test_streaming_v2.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from engine.families.chunking import OverlappingChunks
from engine.llm.sampling import SamplingOptions
from engine.runtime.pipeline import CosyVoice
from engine.runtime.synthesis_request import SynthesisRequest


@dataclass(frozen=True)
class Setup:
    text: str
    other_text: str  # a second request, streamed beside the first
    sampling: SamplingOptions
    voices: tuple[int, int]  # indices in tts.voices of the two requests' speakers


SETUPS = {
    # a fixed speech length of 3 chunks and a half: 12 text tokens x 30 = 360 tokens
    "tiny": Setup(
        "Streaming makes the first audio come early.",
        "A second voice.",
        SamplingOptions(seed=11, min_token_text_ratio=30, max_token_text_ratio=30),
        voices=(1, 0),  # dummy_male, dummy_female
    ),
    # the random dummy LLM may stop early on its other stop tokens: this seed gives 111 tokens (3 chunks)
    "cosyvoice2-tiny": Setup(
        "Streaming in version two.",
        "Another one.",
        SamplingOptions(seed=1, min_token_text_ratio=6, max_token_text_ratio=6),
        voices=(0, 1),
    ),
}


def encode(tts: CosyVoice, text: str, voice: int, sampling: SamplingOptions):
    [segment] = tts.encoder.encode(SynthesisRequest(text, tts.voices[voice], sampling=sampling))
    return segment


def run_stream(stream) -> tuple[list[np.ndarray], list[int]]:
    """-> the non-empty chunks of segment 0, and the step at which each arrived."""
    chunks, steps = [], []
    for step, outputs in enumerate(stream, start=1):
        if outputs[0] is not None and len(outputs[0]):
            chunks.append(outputs[0])
            steps.append(step)
    return chunks, steps


@pytest.fixture(scope="module", params=list(SETUPS))
def preset(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def tts(preset: str) -> CosyVoice:
    return CosyVoice.load(preset)


@pytest.fixture(scope="module")
def segment(tts: CosyVoice, preset: str):
    return encode(tts, SETUPS[preset].text, SETUPS[preset].voices[0], SETUPS[preset].sampling)


@pytest.fixture(scope="module")
def other(tts: CosyVoice, preset: str):
    return encode(tts, SETUPS[preset].other_text, SETUPS[preset].voices[1], SETUPS[preset].sampling)


def test_no_discontinuity_at_the_seams(tts: CosyVoice, segment) -> None:
    chunks, _ = run_stream(tts.decoder.open_stream([segment]))
    assert len(chunks) >= 2
    audio = np.concatenate(chunks)
    assert np.isfinite(audio).all()
    jumps = np.abs(np.diff(audio))
    typical = np.percentile(jumps, 99.9)
    for seam in np.cumsum([len(c) for c in chunks[:-1]]):
        assert jumps[seam - 1] <= typical, f"jump {jumps[seam - 1]:.4f} at the seam {seam} (99.9th pct {typical:.4f})"


def test_streams_in_one_batch_equal_streams_alone(tts: CosyVoice, segment, other) -> None:
    together: list[list[np.ndarray]] = [[], []]
    for outputs in tts.decoder.open_stream([segment, other]):
        for index, chunk in enumerate(outputs):
            if chunk is not None:
                together[index].append(chunk)
    for index, seg in enumerate([segment, other]):
        alone = np.concatenate([c for c in (o[0] for o in tts.decoder.open_stream([seg])) if c is not None])
        np.testing.assert_allclose(np.concatenate(together[index]), alone, atol=1e-4)


def test_cancel_frees_the_slot_at_the_next_step(tts: CosyVoice, segment, other) -> None:
    stream = tts.decoder.open_stream([segment, other])
    iterator = iter(stream)
    for _ in range(5):
        next(iterator)
    assert stream.llm.batch_size == 2
    stream.cancel(0)
    outputs = next(iterator)
    assert outputs[0] is None and stream.llm.batch_size == 1
    for outputs in iterator:
        assert outputs[0] is None
    assert stream.finished


@pytest.fixture(scope="module")
def v1_tts() -> CosyVoice:
    return CosyVoice.load("tiny")


@pytest.fixture(scope="module")
def v1_segment(v1_tts: CosyVoice):
    setup = SETUPS["tiny"]
    return encode(v1_tts, setup.text, setup.voices[0], setup.sampling)


def test_v1_first_chunk_comes_after_the_first_hop_and_the_rest_follows(v1_tts: CosyVoice, v1_segment) -> None:
    schedule = OverlappingChunks(v1_tts.decoder).schedule
    assert (schedule.token_hop, schedule.token_overlap) == (100, 20)  # the official v1 chunking at 50 tokens/s
    total_tokens = v1_segment.text_len * 30
    chunks, steps = run_stream(v1_tts.decoder.open_stream([v1_segment]))
    assert steps[0] == schedule.token_hop + schedule.token_overlap  # one token per step
    assert steps[0] < total_tokens  # long before the utterance is generated
    assert len(chunks) == 1 + (total_tokens - schedule.token_overlap) // schedule.token_hop


def test_v1_joined_stream_has_the_whole_utterance_length(v1_tts: CosyVoice, v1_segment) -> None:
    chunks, _ = run_stream(v1_tts.decoder.open_stream([v1_segment]))
    streamed = np.concatenate(chunks)
    [whole] = v1_tts.decoder.decode_batch([v1_segment])
    # chunk mel lengths are rounded per chunk: at most one frame (256 samples) per chunk apart
    assert abs(len(streamed) - len(whole)) <= 256 * len(chunks)
    assert np.isfinite(streamed).all()
