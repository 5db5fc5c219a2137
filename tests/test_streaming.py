"""Streaming synthesis: chunk timing, total length, seams, cancellation, batching of streams."""

from __future__ import annotations

import numpy as np
import pytest

from engine.pipeline import CosyVoice, SynthesisRequest
from engine.sampling import SamplingOptions
from engine.streaming import OverlappingChunks

# A fixed speech length of 3 chunks and a half: 12 text tokens x 30 = 360 tokens.
FIXED = SamplingOptions(seed=11, min_token_text_ratio=30, max_token_text_ratio=30)


@pytest.fixture(scope="module")
def tts() -> CosyVoice:
    return CosyVoice.load("tiny")


@pytest.fixture(scope="module")
def segment(tts: CosyVoice):
    [segment] = tts.encoder.encode(
        SynthesisRequest("Streaming makes the first audio come early.", "dummy_male", sampling=FIXED)
    )
    return segment


def _run(stream) -> tuple[list[np.ndarray], list[int]]:
    """-> the non-empty chunks of segment 0, and the step at which each arrived."""
    chunks, steps = [], []
    for step, outputs in enumerate(stream, start=1):
        if outputs[0] is not None and len(outputs[0]):
            chunks.append(outputs[0])
            steps.append(step)
    return chunks, steps


def test_first_chunk_comes_after_the_first_hop_and_the_rest_follows(tts: CosyVoice, segment) -> None:
    schedule = OverlappingChunks(tts.decoder).schedule
    assert (schedule.token_hop, schedule.token_overlap) == (100, 20)  # the official v1 chunking at 50 tokens/s
    total_tokens = segment.text_len * 30
    chunks, steps = _run(tts.decoder.open_stream([segment]))
    assert steps[0] == schedule.token_hop + schedule.token_overlap  # one token per step
    assert steps[0] < total_tokens  # long before the utterance is generated
    assert len(chunks) == 1 + (total_tokens - schedule.token_overlap) // schedule.token_hop


def test_joined_stream_has_the_whole_utterance_length(tts: CosyVoice, segment) -> None:
    chunks, _ = _run(tts.decoder.open_stream([segment]))
    streamed = np.concatenate(chunks)
    [whole] = tts.decoder.decode_batch([segment])
    # chunk mel lengths are rounded per chunk: at most one frame (256 samples) per chunk apart
    assert abs(len(streamed) - len(whole)) <= 256 * len(chunks)
    assert np.isfinite(streamed).all()


def test_no_discontinuity_at_the_seams(tts: CosyVoice, segment) -> None:
    chunks, _ = _run(tts.decoder.open_stream([segment]))
    audio = np.concatenate(chunks)
    jumps = np.abs(np.diff(audio))
    seams = np.cumsum([len(c) for c in chunks[:-1]])
    typical = np.percentile(jumps, 99.9)
    for seam in seams:
        assert jumps[seam - 1] <= typical, f"jump {jumps[seam - 1]:.4f} at the seam {seam} (99.9th pct {typical:.4f})"


def test_streams_in_one_batch_equal_streams_alone(tts: CosyVoice, segment) -> None:
    [other] = tts.encoder.encode(SynthesisRequest("A second voice.", "dummy_female", sampling=FIXED))
    together = [[], []]
    for outputs in tts.decoder.open_stream([segment, other]):
        for index, chunk in enumerate(outputs):
            if chunk is not None:
                together[index].append(chunk)
    for index, seg in enumerate([segment, other]):
        alone = np.concatenate([c for c in (o[0] for o in tts.decoder.open_stream([seg])) if c is not None])
        np.testing.assert_allclose(np.concatenate(together[index]), alone, atol=1e-4)


def test_cancel_frees_the_slot_at_the_next_step(tts: CosyVoice, segment) -> None:
    [other] = tts.encoder.encode(SynthesisRequest("Keep going.", "dummy_female", sampling=FIXED))
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
