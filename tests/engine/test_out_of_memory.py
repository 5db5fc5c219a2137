"""Out of device memory degrades, never fails (engine.runtime.scheduler): a `torch.cuda.OutOfMemoryError` injected
into the loop's work (half-way through an LLM step, into flow + vocoder runs) on the tiny model: the work is put
back and retried under a lowered live limit, and every request completes with the audio it has without the fault;
a request that runs out of memory even alone ends with a 503 naming the limit while the others complete."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from engine.errors import UnavailableError
from engine.llm.generation import TokenGenerator
from engine.llm.sampling import SamplingOptions
from engine.nn.conformer import KVCache
from engine.runtime.pipeline import CosyVoice
from engine.runtime.scheduler import Scheduler
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import SynthesisRequest
from tests.engine.conftest import Collected, decode_to_end

BACKOFF_S = 30.0
POISON_SEED = 666


@pytest.fixture(scope="module")
def tts() -> CosyVoice:
    return CosyVoice.load("tiny")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _segment(tts: CosyVoice, text: str, seed: int, ratio: float) -> EncodedSegment:
    sampling = SamplingOptions(seed=seed, min_token_text_ratio=ratio, max_token_text_ratio=ratio)
    [segment] = tts.encoder.encode(SynthesisRequest(text, tts.voices[0], sampling=sampling))
    return segment


def _requests(tts: CosyVoice) -> list[tuple[EncodedSegment, bool]]:
    return [
        (_segment(tts, "A streaming request, long enough for several chunks.", 4, 14.0), True),
        (_segment(tts, "A whole request beside it.", 5, 6.0), False),
        (_segment(tts, "Another stream.", 6, 10.0), True),
        (_segment(tts, "Another whole one, a little longer.", 7, 5.0), False),
    ]


def _decode(
    tts: CosyVoice, requests: list[tuple[EncodedSegment, bool]], clock: Clock | None = None
) -> tuple[Scheduler, list[Collected]]:
    """Submit every (segment, streaming) at once to a fresh loop and run it to its end; its LLM rows are never held
    for a first audio, as on a GPU (the only device that runs out of memory so), so the injected faults hit the
    batches they are meant for."""
    scheduler = Scheduler(
        tts.decoder, max_live=8, max_vocode_batch=4, clock=clock or Clock(), oom_backoff_s=BACKOFF_S, hold_rows=False
    )
    return scheduler, decode_to_end(scheduler, requests)


def _out_of_memory_when(hit: Callable[..., bool], work: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if hit(*args, **kwargs):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return work(*args, **kwargs)

    return wrapped


def _calls(numbers: set[int], counted: Callable[..., bool] = lambda *_: True) -> Callable[..., bool]:
    """True on the given calls (1-based) among those `counted`."""
    seen = [0]

    def hit(*args: Any) -> bool:
        if not counted(*args):
            return False
        seen[0] += 1
        return seen[0] in numbers

    return hit


def test_out_of_memory_in_llm_steps_and_vocoder_runs_loses_no_request(
    tts: CosyVoice, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = _requests(tts)
    _, clean = _decode(tts, requests)

    # Half-way through the decoding steps of the running batch of four, then of two (after the cache took the
    # step's column and block 0 wrote its keys); flow + vocoder runs, whole and streamed, never twice in a row (a
    # run that fails alone is retried at once: failing again would mean it cannot fit alone).
    store = KVCache.store
    llm_hit = _calls({2, 3}, counted=lambda _cache, block, k, _v: block == 1 and k.shape[0] >= 2)
    monkeypatch.setattr(KVCache, "store", _out_of_memory_when(llm_hit, store))
    stage = tts.decoder
    monkeypatch.setattr(stage, "vocode", _out_of_memory_when(_calls({1}), stage.vocode))
    strategy_class = type(Scheduler(tts.decoder, max_live=1).streams.strategy)
    monkeypatch.setattr(strategy_class, "vocode", _out_of_memory_when(_calls({1, 3}), strategy_class.vocode))
    clock = Clock()
    scheduler, faulty = _decode(tts, requests, clock)

    stats = scheduler.stats
    assert stats.out_of_memory == 5 and stats.oom_ended == 0 and stats.oom_paused == 3
    for alone, beside in zip(clean, faulty, strict=True):
        assert beside.error is None
        assert [len(c) for c in beside.chunks] == [len(c) for c in alone.chunks]  # no chunk lost or made twice
        np.testing.assert_allclose(beside.audio, alone.audio, atol=1e-4)
    # The limit holds for a while, then is doubled back once each backoff without another out-of-memory.
    assert scheduler.live_limit == stats.oom_live_limit == 1
    clock.now += BACKOFF_S
    scheduler.step()
    assert scheduler.live_limit == stats.oom_live_limit == 2
    for _ in range(2):
        clock.now += BACKOFF_S
        scheduler.step()
    assert scheduler.live_limit == 8 and stats.oom_live_limit is None


def _poison(where: str, tts: CosyVoice, monkeypatch: pytest.MonkeyPatch) -> None:
    """The poisoned request's work runs out of memory every time, whatever shares it."""
    llm = tts.decoder.model.llm
    if where == "prefill":
        hit = lambda request: request.options.seed == POISON_SEED  # noqa: E731
        monkeypatch.setattr(llm, "lm_input", _out_of_memory_when(hit, llm.lm_input))
    else:
        strategy_class = type(Scheduler(tts.decoder, max_live=1).streams.strategy)
        hit = lambda _self, chunks, _mels: any(c.stream.segment.sampling.seed == POISON_SEED for c in chunks)  # noqa: E731
        monkeypatch.setattr(strategy_class, "vocode", _out_of_memory_when(hit, strategy_class.vocode))


@pytest.mark.parametrize("where", ["prefill", "stream_vocoder"])
def test_a_request_that_runs_out_of_memory_alone_ends_with_503_and_the_others_complete(
    tts: CosyVoice, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    others = _requests(tts)[:2]
    _, clean = _decode(tts, others)
    poisoned = (_segment(tts, "The request too large for this replica.", POISON_SEED, 10.0), True)
    _poison(where, tts, monkeypatch)
    scheduler, faulty = _decode(tts, [others[0], poisoned, others[1]])

    bad = faulty.pop(1)
    assert bad.ended and isinstance(bad.error, UnavailableError) and bad.error.http_status == 503
    assert "device memory" in bad.error.message and "memory of its cpu device" in bad.error.message
    assert scheduler.stats.oom_ended == 1
    for alone, beside in zip(clean, faulty, strict=True):
        assert beside.error is None
        np.testing.assert_allclose(beside.audio, alone.audio, atol=1e-4)


@pytest.mark.parametrize("fails", [{1}, {1, 2}])
def test_an_admission_out_of_memory_with_nothing_else_live_is_tried_once_alone(
    tts: CosyVoice, fails: set[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy of a request's inputs to the device runs out with nothing else live: nothing can be freed for it, so
    it is tried at once, alone (waiting for a lower limit cannot help); failing again, its request ends with the 503."""
    request = _requests(tts)[1]
    _, [clean] = _decode(tts, [request])
    monkeypatch.setattr(TokenGenerator, "add", _out_of_memory_when(_calls(fails), TokenGenerator.add))
    scheduler, [sink] = _decode(tts, [request])
    assert sink.ended and scheduler.stats.out_of_memory == len(fails)
    if len(fails) == 1:
        assert sink.error is None
        np.testing.assert_allclose(sink.audio, clean.audio, atol=1e-4)
    else:
        assert isinstance(sink.error, UnavailableError) and scheduler.stats.oom_ended == 1


def test_a_resumed_request_without_room_for_its_kept_cache_is_recomputed_with_the_same_tokens(
    tts: CosyVoice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`TokenGenerator.resume` merges a kept KV cache into the batch's: with no memory for the merge it drops the
    kept rows and prefills the request again, losing no token and moving no sampler."""
    segments = [_segment(tts, text, seed, 8.0) for text, seed in (("The first one.", 1), ("And a second.", 2))]
    requests = tts.decoder.generation_requests(segments)

    def tokens(interrupt: bool) -> list[list[int]]:
        generator = TokenGenerator(tts.decoder.model.llm)
        ids = [generator.add(request) for request in requests]
        out: dict[int, list[int]] = {i: [] for i in ids}
        for step in range(1000):
            if interrupt and step == 5:
                generator.pause([ids[1]], keep_cache=True)
            if interrupt and step == 8:
                with monkeypatch.context() as patch:  # only this resume's merge runs out
                    patch.setattr(KVCache, "concat", _out_of_memory_when(lambda *_: True, KVCache.concat))
                    generator.resume([ids[1]])
            if not generator.active and not generator.paused:
                break
            for event in generator.step():
                if event.token is not None:
                    out[event.request_id].append(event.token)
        return [out[i] for i in ids]

    assert tokens(interrupt=True) == tokens(interrupt=False)
