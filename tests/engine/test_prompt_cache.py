"""The decoder's cache of prepared voice prompts (engine.runtime.prompt_cache) on the tiny v1, v2 and v3 models: a hit
gives the audio a miss gives (whole and streamed, in the decoder loop), the LRU keeps to its byte bound, a voice
registered again with another prompt misses, and the cache's bytes count against the loop's memory budget."""

from __future__ import annotations

import numpy as np
import pytest

from engine.llm.sampling import SamplingOptions
from engine.runtime.pipeline import CosyVoice
from engine.runtime.prompt_cache import DEFAULT_PROMPT_CACHE_BYTES, PromptCache, prompt_cache_bound
from engine.runtime.scheduler import Scheduler
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.cloning import VoicePrompt
from tests.engine.conftest import Collected, step_until

SAMPLING = SamplingOptions(seed=5, min_token_text_ratio=4, max_token_text_ratio=5)
TRANSCRIPT = "This is what the prompt says."


@pytest.fixture(scope="module", params=["tiny", "cosyvoice2-tiny", "cosyvoice3-tiny"])
def tts(request: pytest.FixtureRequest) -> CosyVoice:
    return CosyVoice.load(request.param)


def make_prompt(tts: CosyVoice, seed: int = 0, tokens: int = 20) -> VoicePrompt:
    rng = np.random.default_rng(seed)
    return VoicePrompt(
        transcript=TRANSCRIPT,
        embedding=rng.standard_normal(192).astype(np.float32),
        speech_tokens=rng.integers(0, 96, tokens).astype(np.int64),
        speech_feat=rng.standard_normal((2 * tokens, 80)).astype(np.float32),  # the v2/v3 alignment; v1 takes any
        sample_rate=tts.sample_rate,
        family=tts.encoder.model.config.family.name,
    )


def segment(tts: CosyVoice, prompt: VoicePrompt, text: str, voice: str = "voice_a") -> EncodedSegment:
    [encoded] = tts.encoder.encode(SynthesisRequest(text, voice, sampling=SAMPLING), prompt=prompt)
    return encoded


def run(scheduler: Scheduler, segments: list[EncodedSegment], streaming: bool) -> list[np.ndarray]:
    """Each segment as its own request, all in the loop at once -> each one's audio."""
    sinks = [Collected() for _ in segments]
    for one, sink in zip(segments, sinks, strict=True):
        scheduler.submit([one], streaming=streaming, sink=sink)
    step_until(scheduler, lambda: not scheduler.has_work)
    return [sink.audio for sink in sinks]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_hit_gives_the_audio_of_a_miss(tts: CosyVoice, streaming: bool) -> None:
    prompt = make_prompt(tts)
    first = segment(tts, prompt, "The first sentence in this voice.")
    other = segment(tts, prompt, "Something else, said a little later.")
    uncached = run(Scheduler(tts.decoder, max_live=4, prompt_cache_bytes=0), [first, other], streaming)
    scheduler = Scheduler(tts.decoder, max_live=4)
    [miss] = run(scheduler, [first], streaming)
    stats = scheduler.prompt_cache.stats
    assert (stats.hits, stats.misses, len(scheduler.prompt_cache)) == (0, 1, 1)
    entry = scheduler.prompt_cache.get((first.voice, first.prompt_key), count=False)
    assert entry.prefix is not None and entry.prefix.rows > 1  # sos and the transcript (v1: and the speaker term)
    hits = run(scheduler, [first, other], streaming)  # together in one LLM batch, both from the kept prefix
    assert (stats.hits, stats.misses) == (2, 1)
    np.testing.assert_allclose(miss, uncached[0], atol=1e-4)
    for hit, reference in zip(hits, uncached, strict=True):
        np.testing.assert_allclose(hit, reference, atol=1e-4)


def test_a_voice_registered_again_with_another_prompt_misses(tts: CosyVoice) -> None:
    scheduler = Scheduler(tts.decoder, max_live=4)
    old = segment(tts, make_prompt(tts, seed=0), "Same words.")
    new = segment(tts, make_prompt(tts, seed=1), "Same words.")
    assert old.voice == new.voice and old.prompt_key != new.prompt_key
    instructed = tts.encoder.encode(
        SynthesisRequest("Same words.", "voice_a", sampling=SAMPLING, instruct_text="Speak slowly."),
        prompt=make_prompt(tts, seed=0),
    )[0]
    assert instructed.prompt_key not in (old.prompt_key, new.prompt_key)  # another prompt text: another prefix
    run(scheduler, [old], streaming=False)
    [new_audio] = run(scheduler, [new], streaming=False)
    assert (scheduler.prompt_cache.stats.hits, scheduler.prompt_cache.stats.misses) == (0, 2)
    [alone] = run(Scheduler(tts.decoder, max_live=4, prompt_cache_bytes=0), [new], streaming=False)
    np.testing.assert_allclose(new_audio, alone, atol=1e-4)
    assert scheduler.prompt_cache.forget_voice("voice_a") == 2 and not scheduler.prompt_cache.nbytes


def test_the_lru_keeps_within_its_byte_bound(tts: CosyVoice) -> None:
    probe = Scheduler(tts.decoder, max_live=4)
    run(probe, [segment(tts, make_prompt(tts), "Sized.", voice="v0")], streaming=False)
    size = probe.prompt_cache.nbytes
    scheduler = Scheduler(tts.decoder, max_live=4, prompt_cache_bytes=2 * size)
    voices = [segment(tts, make_prompt(tts), "Sized.", voice=f"v{i}") for i in range(3)]
    run(scheduler, voices[:2], streaming=False)
    cache = scheduler.prompt_cache
    assert len(cache) == 2 and cache.nbytes == 2 * size
    run(scheduler, [voices[0]], streaming=False)  # v0 is now the most recently used
    run(scheduler, [voices[2]], streaming=False)  # v1, the least recently used, makes room
    assert cache.nbytes <= cache.max_bytes and cache.stats.evictions == 1
    assert [(v.voice, v.prompt_key) in cache for v in voices] == [True, False, True]
    entry = cache.get(("v0", voices[0].prompt_key))  # v0 is the most recently used again
    assert not PromptCache(size - 1).put(("big", "key"), entry)  # larger than the whole bound: not kept
    cache.resize(size)  # the replica's budget shrank: the most recently used entry stays
    assert [(v.voice, v.prompt_key) in cache for v in voices] == [True, False, False]


def test_the_bound_is_a_share_of_the_memory_budget() -> None:
    assert prompt_cache_bound(1000, 0.1) == 100
    assert prompt_cache_bound(None, 0.1) == DEFAULT_PROMPT_CACHE_BYTES  # no budget: a fixed bound
    assert prompt_cache_bound(None, 0.0) == prompt_cache_bound(1000, 0.0) == 0  # off
    with pytest.raises(ValueError, match="share"):
        prompt_cache_bound(1000, 1.0)


def test_the_cache_gives_its_bytes_back_to_a_sentence_that_needs_them(tts: CosyVoice) -> None:
    first = segment(tts, make_prompt(tts), "One voice.", voice="v0")
    second = segment(tts, make_prompt(tts, seed=2), "Another voice.", voice="v1")
    probe = Scheduler(tts.decoder, max_live=4)
    run(probe, [first], streaming=False)
    entry = probe.prompt_cache.nbytes
    need = max(probe.limits.memory_estimate(first), probe.limits.memory_estimate(second))
    # room for one sentence and one entry: the second voice's entry must push the first one's out to fit
    scheduler = Scheduler(tts.decoder, max_live=4, memory_budget_bytes=need + entry, prompt_cache_bytes=2 * entry)
    run(scheduler, [first], streaming=False)
    assert scheduler.prompt_cache.nbytes == entry
    run(scheduler, [second], streaming=False)
    assert scheduler.prompt_cache.stats.evictions >= 1
    assert scheduler.prompt_cache.nbytes == entry and ("v1", second.prompt_key) in scheduler.prompt_cache
