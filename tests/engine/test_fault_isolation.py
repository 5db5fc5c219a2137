"""A bad request fails alone: a fault injected into one request's work inside the decoder loop (its prefill, its
sampling, its flow or its vocoder, whole or streamed) ends that request with an error, and the requests beside it
complete with the audio they have without it, on every tiny family. Also the decoder's own input checks and the
ceilings every request has (audio length, wall time)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import engine.llm.generation
from engine.errors import DecodeLimitError, InvalidInputError, RequestFailedError
from engine.llm.sampling import MAX_SEED, SamplingOptions
from engine.runtime.pipeline import CosyVoice
from engine.runtime.scheduler import Scheduler
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import SynthesisRequest
from tests.engine.conftest import Collected, decode_to_end

POISON_SEED = 666  # the request the fault is injected into
MODELS = ("tiny", "cosyvoice2-tiny", "cosyvoice3-tiny")


@pytest.fixture(scope="module", params=MODELS)
def tts(request: pytest.FixtureRequest) -> CosyVoice:
    return CosyVoice.load(request.param)


def _segment(tts: CosyVoice, text: str, seed: int, ratio: float) -> EncodedSegment:
    sampling = SamplingOptions(seed=seed, min_token_text_ratio=ratio, max_token_text_ratio=ratio)
    [segment] = tts.encoder.encode(SynthesisRequest(text, tts.voices[0], sampling=sampling))
    return segment


def _poisoned(seed: int | None) -> bool:
    return seed == POISON_SEED


def _fail_if(poisoned: Callable[..., bool], work: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if poisoned(*args, **kwargs):
            raise RuntimeError("injected fault")
        return work(*args, **kwargs)

    return wrapped


def _inject(where: str, tts: CosyVoice, scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the poisoned request's work raise at `where` (whatever else shares its batch)."""
    stage, strategy = tts.decoder, scheduler.streams.strategy
    if where == "prefill":
        llm = stage.model.llm
        monkeypatch.setattr(llm, "lm_input", _fail_if(lambda request: _poisoned(request.options.seed), llm.lm_input))
    elif where == "sampling":
        sample = engine.llm.generation.sample_token
        monkeypatch.setattr(
            engine.llm.generation, "sample_token", _fail_if(lambda _s, _h, options, _g: _poisoned(options.seed), sample)
        )
    elif where == "whole_flow":
        hit = lambda segments, _tokens: any(_poisoned(s.sampling.seed) for s in segments)  # noqa: E731
        monkeypatch.setattr(stage, "tokens_to_mel", _fail_if(hit, stage.tokens_to_mel))
    elif where == "whole_vocoder":
        hit = lambda segments, _mels: any(_poisoned(s.sampling.seed) for s in segments)  # noqa: E731
        monkeypatch.setattr(stage, "vocode", _fail_if(hit, stage.vocode))
    elif where == "stream_flow":
        hit = lambda chunks: any(_poisoned(c.stream.segment.sampling.seed) for c in chunks)  # noqa: E731
        monkeypatch.setattr(strategy, "chunk_mels", _fail_if(hit, strategy.chunk_mels))
    elif where == "stream_vocoder":
        hit = lambda chunks, _mels: any(_poisoned(c.stream.segment.sampling.seed) for c in chunks)  # noqa: E731
        monkeypatch.setattr(strategy, "vocode", _fail_if(hit, strategy.vocode))
    else:
        raise AssertionError(where)


def _decode(tts: CosyVoice, requests: list[tuple[EncodedSegment, bool]], setup: Callable[[Scheduler], None]) -> list:
    """Submit every (segment, streaming) at once to a fresh loop and run it to its end -> each request's sink."""
    scheduler = Scheduler(tts.decoder, max_live=8, max_vocode_batch=4)
    setup(scheduler)
    sinks = decode_to_end(scheduler, requests)
    assert scheduler.stats.request_faults == sum(isinstance(s.error, RequestFailedError) for s in sinks)
    return sinks


FAULTS = {  # where -> whether the poisoned request streams
    "prefill": True,
    "sampling": False,
    "whole_flow": False,
    "whole_vocoder": False,
    "stream_flow": True,
    "stream_vocoder": True,
}


@pytest.mark.slow
@pytest.mark.parametrize("where", list(FAULTS))
def test_a_fault_in_one_requests_work_fails_that_request_alone(
    tts: CosyVoice, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    others = [
        (_segment(tts, "A streaming request beside the bad one, long enough for chunks.", 4, 12.0), True),
        (_segment(tts, "A whole request beside it.", 5, 6.0), False),
        (_segment(tts, "Another stream.", 6, 8.0), True),
        (_segment(tts, "Another whole one.", 7, 5.0), False),
    ]
    poisoned = (_segment(tts, "The request that fails inside the loop.", POISON_SEED, 10.0), FAULTS[where])
    clean = _decode(tts, others, lambda _: None)
    faulty = _decode(tts, [others[0], poisoned, *others[1:]], lambda s: _inject(where, tts, s, monkeypatch))

    bad = faulty.pop(1)
    assert isinstance(bad.error, RequestFailedError) and bad.ended
    assert isinstance(bad.error.__cause__, RuntimeError)  # kept for the decoder's log line
    for alone, beside in zip(clean, faulty, strict=True):
        assert beside.error is None
        assert beside.audio.shape == alone.audio.shape
        np.testing.assert_allclose(beside.audio, alone.audio, atol=1e-4)


def test_a_fault_of_the_whole_batch_ends_the_loop_not_just_one_request(
    tts: CosyVoice, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = Scheduler(tts.decoder, max_live=8)
    sinks = [Collected(), Collected()]
    for seed, sink in zip((1, 2), sinks, strict=True):
        scheduler.submit([_segment(tts, "Two requests in one batch.", seed, 8.0)], streaming=False, sink=sink)
    scheduler.step()
    scheduler.step()  # both are running
    forward = tts.decoder.model.llm.llm.forward_incremental
    monkeypatch.setattr(tts.decoder.model.llm.llm, "forward_incremental", _fail_if(lambda *a: True, forward))
    with pytest.raises(RuntimeError, match="injected"):
        scheduler.step()  # a decoding step of the running batch: no single request explains it


def _with_sampling(segment: EncodedSegment, **fields: Any) -> EncodedSegment:
    """`segment` with sampling fields set past the constructor's checks, as an unpickled object may have them."""
    sampling = replace(segment.sampling)
    for name, value in fields.items():
        object.__setattr__(sampling, name, value)
    return replace(segment, sampling=sampling)


BAD_SEGMENTS: dict[str, Callable[[EncodedSegment], EncodedSegment]] = {
    "nan ratio": lambda s: _with_sampling(s, min_token_text_ratio=math.nan),
    "huge win_size": lambda s: _with_sampling(s, win_size=10**400),
    "huge ratio": lambda s: _with_sampling(s, min_token_text_ratio=1e5, max_token_text_ratio=1e5),
    "no seed": lambda s: _with_sampling(s, seed=None),
    "nan speed": lambda s: replace(s, speed=math.nan),
    "nan text": lambda s: replace(s, text_encoded=np.full_like(s.text_encoded, np.nan)),
    "wrong width": lambda s: replace(s, text_encoded=s.text_encoded[:, :3]),
    "text_len past the text": lambda s: replace(s, text_len=len(s.text_encoded) + 1),
    "inf embedding": lambda s: replace(s, flow_embedding=np.full_like(s.flow_embedding, np.inf)),
    "token past the vocabulary": lambda s: replace(s, flow_prompt_speech_tokens=np.array([10**6], dtype=np.int64)),
    "float tokens": lambda s: replace(s, llm_prompt_speech_tokens=np.zeros(3, dtype=np.float32)),
    "too many prompt tokens": lambda s: replace(s, llm_prompt_speech_tokens=np.zeros(10**5, dtype=np.int64)),
    "bad prompt mel": lambda s: replace(s, prompt_feat=np.zeros((4, 7), dtype=np.float32)),
}


@pytest.mark.parametrize("name", list(BAD_SEGMENTS))
@pytest.mark.parametrize("streaming", [False, True])
def test_the_decoder_refuses_a_bad_segment_before_it_queues(tts: CosyVoice, name: str, streaming: bool) -> None:
    segment = BAD_SEGMENTS[name](_segment(tts, "Checked again where the engine takes it.", 3, 4.0))
    scheduler = Scheduler(tts.decoder, max_live=4)
    with pytest.raises(InvalidInputError):
        scheduler.submit([segment], streaming=streaming, sink=Collected())
    assert not scheduler.has_work


@pytest.mark.parametrize("streaming", [False, True])
def test_a_request_past_its_audio_ceiling_ends_with_413_and_frees_its_slot(tts: CosyVoice, streaming: bool) -> None:
    scheduler = Scheduler(tts.decoder, max_live=1, max_audio_s=0.5)
    long, short = Collected(), Collected()
    scheduler.submit([_segment(tts, "This one would speak for far too long.", 1, 40.0)], streaming=streaming, sink=long)
    scheduler.submit([_segment(tts, "Hi.", 2, 2.0)], streaming=streaming, sink=short)  # waits for the one slot
    while scheduler.has_work:
        scheduler.step()
    assert isinstance(long.error, DecodeLimitError) and long.error.http_status == 413
    assert "0.5 s of audio" in long.error.message
    assert short.error is None and short.ended
    assert scheduler.stats.over_limit == 1 and scheduler.live == 0 and scheduler.llm.active == 0


def test_a_request_past_its_deadline_ends_with_413_queued_or_live(tts: CosyVoice) -> None:
    now = [0.0]
    scheduler = Scheduler(tts.decoder, max_live=1, max_request_s=10.0, clock=lambda: now[0])
    live, queued = Collected(), Collected()
    scheduler.submit([_segment(tts, "Too slow for its deadline.", 1, 20.0)], streaming=True, sink=live)
    scheduler.submit([_segment(tts, "Queued behind it.", 2, 20.0)], streaming=False, sink=queued)
    for _ in range(3):
        scheduler.step()
    assert scheduler.live == 1 and scheduler.queued == 1
    now[0] = 10.5
    scheduler.step()
    for sink in (live, queued):
        assert isinstance(sink.error, DecodeLimitError) and "longer than the limit of 10 s" in sink.error.message
    while scheduler.has_work:
        scheduler.step()
    assert scheduler.stats.over_limit == 2 and scheduler.live == 0 and scheduler.llm.active == 0


def test_the_largest_seed_is_valid_for_every_sentence_of_a_request(tts: CosyVoice) -> None:
    sampling = SamplingOptions(seed=MAX_SEED, max_token_text_ratio=2.0)
    text = "This is a much longer request that keeps the decoder busy for a while. " * 8
    segments = tts.encoder.encode(SynthesisRequest(text, tts.voices[0], sampling=sampling))
    assert [s.sampling.seed for s in segments[:2]] == [MAX_SEED, 0]
    scheduler = Scheduler(tts.decoder, max_live=2)
    scheduler.submit(segments, streaming=True, sink=Collected())  # the decoder's own check takes both
