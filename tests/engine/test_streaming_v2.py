"""CosyVoice2 streaming: chunks aligned to the 25-token flow chunks with 3 look-ahead tokens, growing hops,
the whole-prefix causal flow; on the tiny v2 dummy model (what every family's streaming shares: test_streaming.py)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.runtime.pipeline import CosyVoice
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.cloning import VoicePrompt
from tests.engine.test_streaming import SETUPS, run_stream

SETUP = SETUPS["cosyvoice2-tiny"]
FIXED, TEXT = SETUP.sampling, SETUP.text


@pytest.fixture(scope="module")
def tts() -> CosyVoice:
    return CosyVoice.load("cosyvoice2-tiny")


@pytest.fixture(scope="module")
def segment(tts: CosyVoice):
    [segment] = tts.encoder.encode(SynthesisRequest(TEXT, tts.voices[0], sampling=FIXED))
    return segment


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
    chunks, steps = run_stream(tts.decoder.open_stream([segment]))
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
        family=tts.encoder.model.config.family.name,
    )
    [segment] = tts.encoder.encode(SynthesisRequest(TEXT, tts.voices[0], sampling=FIXED), prompt=prompt)
    [tokens] = tts.decoder.generate_tokens([segment])
    _, steps = run_stream(tts.decoder.open_stream([segment]))
    assert steps[0] == 25 + 15 + 3  # 10 prompt tokens + 15 padding complete the first 25-token chunk
    assert steps[:-1] == expected_chunk_ends(len(tokens), first_hop_pad=15)


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
    chunks, _ = run_stream(tts.decoder.open_stream([segment]))
    assert len(calls) == len(chunks) >= 2
    assert calls == [(True, False)] * (len(calls) - 1) + [(False, True)]
