"""CosyVoice2 streaming: chunks aligned to the 25-token flow chunks with 3 look-ahead tokens, growing hops,
the whole-prefix causal flow, the 8-frame HiFT cache; on the tiny v2 dummy model."""

from __future__ import annotations

import numpy as np
import pytest

from engine.pipeline import CosyVoice, SynthesisRequest
from engine.sampling import SamplingOptions
from engine.voice_cloning import VoicePrompt

# The random dummy LLM may stop early on its other stop tokens: this seed gives 111 tokens (3 chunks).
FIXED = SamplingOptions(seed=1, min_token_text_ratio=6, max_token_text_ratio=6)
TEXT = "Streaming in version two."


@pytest.fixture(scope="module")
def tts() -> CosyVoice:
    return CosyVoice.load("cosyvoice2-tiny")


@pytest.fixture(scope="module")
def segment(tts: CosyVoice):
    [segment] = tts.encoder.encode(SynthesisRequest(TEXT, tts.voices[0], sampling=FIXED))
    return segment


def _run(stream) -> tuple[list[np.ndarray], list[int]]:
    """-> the non-empty chunks of segment 0, and the step at which each arrived."""
    chunks, steps = [], []
    for step, outputs in enumerate(stream, start=1):
        if outputs[0] is not None and len(outputs[0]):
            chunks.append(outputs[0])
            steps.append(step)
    return chunks, steps


def expected_chunk_ends(total_tokens: int, first_hop_pad: int = 0) -> list[int]:
    """Token counts at which the official v2 loop emits a chunk: a hop of 25 (+pad first) + 3 look-ahead tokens,
    hops doubling up to 100."""
    ends, offset, hop = [], 0, 25
    while True:
        this_hop = hop + (first_hop_pad if offset == 0 else 0)
        if total_tokens < offset + this_hop + 3:
            return ends
        ends.append(offset + this_hop + 3)
        offset += this_hop
        hop = min(100, 2 * hop)


def test_chunks_follow_the_v2_schedule_and_join_to_the_whole_length(tts: CosyVoice, segment) -> None:
    [tokens] = tts.decoder.generate_tokens([segment])
    chunks, steps = _run(tts.decoder.open_stream([segment]))
    ends = expected_chunk_ends(len(tokens))
    assert ends == [28, 78], "this seed should give hops of 25 and 50 (+3 look-ahead), then the rest"
    assert steps[: len(ends)] == ends  # one token per step: a chunk as soon as its hop and look-ahead exist
    assert len(chunks) == len(ends) + 1  # and the rest when generation ends
    [whole] = tts.decoder.decode_batch([segment])
    assert len(np.concatenate(chunks)) == len(whole) == 2 * len(tokens) * 480  # 2 mel frames per token


def test_a_prompt_pads_the_first_hop_to_the_flow_chunk_grid(tts: CosyVoice) -> None:
    rng = np.random.default_rng(1)
    prompt = VoicePrompt(
        transcript="A prompt.",
        embedding=rng.standard_normal(192).astype(np.float32),
        speech_tokens=rng.integers(0, 96, 10).astype(np.int64),
        speech_feat=rng.standard_normal((20, 80)).astype(np.float32),
        sample_rate=24000,
    )
    [segment] = tts.encoder.encode(SynthesisRequest(TEXT, tts.voices[0], sampling=FIXED), prompt=prompt)
    [tokens] = tts.decoder.generate_tokens([segment])
    _, steps = _run(tts.decoder.open_stream([segment]))
    assert steps[0] == 25 + 15 + 3  # 10 prompt tokens + 15 padding complete the first 25-token chunk
    assert steps[:-1] == expected_chunk_ends(len(tokens), first_hop_pad=15)


def test_no_discontinuity_at_the_seams(tts: CosyVoice, segment) -> None:
    chunks, _ = _run(tts.decoder.open_stream([segment]))
    audio = np.concatenate(chunks)
    assert np.isfinite(audio).all()
    jumps = np.abs(np.diff(audio))
    typical = np.percentile(jumps, 99.9)
    for seam in np.cumsum([len(c) for c in chunks[:-1]]):
        assert jumps[seam - 1] <= typical, f"jump {jumps[seam - 1]:.4f} at the seam {seam} (99.9th pct {typical:.4f})"


def test_streams_in_one_batch_equal_streams_alone(tts: CosyVoice, segment) -> None:
    [other] = tts.encoder.encode(SynthesisRequest("Another one.", tts.voices[1], sampling=FIXED))
    together: list[list[np.ndarray]] = [[], []]
    for outputs in tts.decoder.open_stream([segment, other]):
        for index, chunk in enumerate(outputs):
            if chunk is not None:
                together[index].append(chunk)
    for index, seg in enumerate([segment, other]):
        alone = np.concatenate([c for c in (o[0] for o in tts.decoder.open_stream([seg])) if c is not None])
        np.testing.assert_allclose(np.concatenate(together[index]), alone, atol=1e-4)


def test_only_the_final_chunk_runs_the_flow_with_full_attention(
    tts: CosyVoice, segment, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Official CosyVoice2Model.tts: intermediate token2wav calls pass stream=True, finalize=False; the last one
    # finalize=True without stream, so the flow attends over the whole sequence.
    flow = tts.decoder.model.flow
    calls: list[tuple[bool, bool]] = []
    original = flow.inference

    def spy(requests, n_timesteps=10, streaming=False, finalize=True):
        calls.append((streaming, finalize))
        return original(requests, n_timesteps, streaming=streaming, finalize=finalize)

    monkeypatch.setattr(flow, "inference", spy)
    chunks, _ = _run(tts.decoder.open_stream([segment]))
    assert len(calls) == len(chunks) >= 2
    assert calls == [(True, False)] * (len(calls) - 1) + [(False, True)]
