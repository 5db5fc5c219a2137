"""The Decoder deployment's continuous-batching loop on a real Serve app (tiny model): a request that arrives
while another decodes joins its LLM batch, whole and streaming requests share one model copy and one loop,
a cancelled stream frees its slot, an idle replica admits without waiting for an admission batch to fill (a busy
one makes only whole requests wait),
a request that can never fit the memory budget is refused with 413, and a streamed request's first sentence
decodes while its later sentences are encoded (a refused later sentence ends the request with its error)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import ray
from ray import serve

from engine.errors import RequestTooLargeError
from engine.llm.sampling import SamplingOptions
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.registry import EVERYONE
from serve_app.audio import PCM_MAX
from serve_app.decoder_args import DecoderArgs
from serve_app.errors import engine_error
from tests.serve.conftest import on_cpus, running_app, wait_until

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

APP = "scheduler"
BUDGET_GB = 0.3  # the tiny model's long stream below needs ~160 MiB; the 29-token sentence at 100 per token ~660


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    args = {
        "decoder": {"num_cpus": 0.2, "memory_budget_gb": BUDGET_GB},
    }
    with running_app(args, APP, deployments=on_cpus(TTSIngress=0.1, Encoder=0.1)) as url:
        yield url


@pytest.fixture(scope="module")
def decoder(base_url: str) -> Any:
    return serve.get_deployment_handle("Decoder", APP)


def _encode(text: str, ratio: float, seed: int) -> list[EncodedSegment]:
    sampling = SamplingOptions(seed=seed, min_token_text_ratio=ratio, max_token_text_ratio=ratio)
    request = SynthesisRequest(text, "dummy_female", sampling=sampling)
    return serve.get_deployment_handle("Encoder", APP).encode.remote(request, "scheduler-test", EVERYONE).result()


def _stats(decoder: Any) -> dict[str, Any]:
    return decoder.batch_stats.remote().result()


def test_a_request_arriving_mid_stream_joins_the_running_batch_on_the_same_model(decoder: Any) -> None:
    long_stream = _encode("A long streaming request keeps the loop busy.", ratio=100, seed=1)
    [short] = _encode("Short.", ratio=4, seed=2)
    chunks = decoder.stream.options(stream=True).remote(long_stream, "long")
    assert len(next(chunks)) > 0  # the long stream is decoding: about 900 tokens, the first chunk at 120
    before = _stats(decoder)
    audio = decoder.synthesize.remote(short, "short").result()
    after = _stats(decoder)
    assert len(audio) > 0
    assert after["joined_running_batch"] > before["joined_running_batch"]
    assert after["mixed_steps"] > before["mixed_steps"]  # one LLM step ran the whole and the streaming request
    assert max(int(size) for size in after["llm_batch_size_counts"]) >= 2
    assert decoder.model_copies.remote().result() == {"llm_modules": 1, "token_generators": 1}

    # The client leaves: the stream's slot is freed at the loop's next step, not when its tokens run out.
    chunks.cancel()
    wait_until(lambda: _stats(decoder)["live"] == 0, 30, "the cancelled stream to leave the loop")
    assert _stats(decoder)["cancelled"] == before["cancelled"] + 1


def test_an_idle_replica_admits_at_once_and_a_busy_one_gathers_arrivals_but_not_streams(decoder: Any) -> None:
    wait_until(lambda: not _stats(decoder)["loop_busy"], 30, "an idle loop")
    assert _stats(decoder)["admission_wait_s"] == 0.0  # an admission batch of an idle loop waits for no other
    long_stream = _encode("A long streaming request keeps the loop busy.", ratio=100, seed=3)
    chunks = decoder.stream.options(stream=True).remote(long_stream, "busy")
    assert len(next(chunks)) > 0
    busy = _stats(decoder)
    assert busy["loop_busy"] and busy["admission_wait_s"] == DecoderArgs().batch_wait_timeout_s
    # Whole requests would now wait an hour for their batch to fill; a stream joins the busy loop at once.
    decoder.reconfigure.remote({"batch_wait_timeout_s": 3600.0}).result()  # as a user_config change does
    short = decoder.stream.options(stream=True).remote(_encode("Short.", ratio=4, seed=4), "short")
    pool = ThreadPoolExecutor(1)
    try:
        assert len(pool.submit(next, short).result(timeout=60)) > 0  # an hour if it waited for a batch
    finally:
        short.cancel()  # ends a `next` still waiting
        pool.shutdown(wait=False)
        decoder.reconfigure.remote({"batch_wait_timeout_s": DecoderArgs().batch_wait_timeout_s}).result()
    chunks.cancel()
    wait_until(lambda: not _stats(decoder)["loop_busy"], 30, "the loop to be idle again")
    assert _stats(decoder)["admission_wait_s"] == 0.0


def test_a_request_that_can_never_fit_is_refused_with_413(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=120) as http:
        huge = {"min_token_text_ratio": 100.0, "max_token_text_ratio": 100.0}
        text = (
            "One long sentence keeps the decoder busy, and it goes on and on with many more words in it so that it "
            "lasts a long while."
        )
        for stream in (False, True):
            body = {"text": text, "voice": "dummy_female", "stream": stream, "format": "pcm", "sampling": huge}
            response = http.post("/v1/tts", json=body)
            assert response.status_code == 413, response.text
            assert "budget" in response.json()["error"]["message"]
        small = {"text": "Hi.", "voice": "dummy_female", "sampling": {"max_token_text_ratio": 4.0}}
        assert http.post("/v1/tts", json=small).status_code == 200


PARAGRAPH = " ".join(["This sentence is here to make the paragraph long enough to be split."] * 12)
# A first sentence of 70 text tokens, then one of 220: at ratio 10 about 54 and 394 MiB, the second over the budget.
TOO_LONG_LATER = " ".join(
    ["A short sentence here."] * 14 + [", ".join(["and then the long sentence goes on with more words"] * 20) + "."]
)


@ray.remote(num_cpus=0)
class HeldSentences:
    """Stands for the encoder's call for a request's later sentences: returns them once the test opens it."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()

    async def get(self, segments: list[EncodedSegment]) -> list[EncodedSegment]:
        await self.opened.wait()
        return segments

    def open(self) -> None:
        self.opened.set()


def _request(text: str, seed: int, ratio: float = 3) -> SynthesisRequest:
    return SynthesisRequest(text, "dummy_female", sampling=SamplingOptions(seed=seed, max_token_text_ratio=ratio))


def _held_stream(decoder: Any, first: list[EncodedSegment], later: list[EncodedSegment], request_id: str) -> Any:
    """The decoder's stream of `first`, its later sentences held until `.open` on the returned actor."""
    held = HeldSentences.remote()
    ref = held.get.remote(later)
    return held, ref, decoder.stream.options(stream=True).remote(first, request_id, [ref])


def test_a_streams_first_sentence_decodes_before_its_later_ones_are_encoded(decoder: Any) -> None:
    encoder = serve.get_deployment_handle("Encoder", APP)
    request = _request(PARAGRAPH, seed=21)
    first, plan = encoder.encode_first.remote(request, "first", EVERYONE).result()
    later = encoder.encode_planned.remote(plan, 1).result()
    everything = encoder.encode.remote(request, "at-once", EVERYONE).result()
    assert len(first) == 1 and plan.num_segments == len(everything) == 3
    held, ref, chunks = _held_stream(decoder, first, later, "held")
    try:
        audio = [next(chunks)]
        ready, _ = ray.wait([ref], timeout=0)
        assert len(audio[0]) > 0 and not ready  # first audio while the later sentences are still being "encoded"
        assert _stats(decoder)["awaiting_sentences"] == 1
    finally:
        held.open.remote()
    audio += list(chunks)
    # The same audio as the request's sentences all encoded first and sent at once.
    at_once = list(decoder.stream.options(stream=True).remote(everything, "at-once"))
    assert [len(chunk) for chunk in audio] == [len(chunk) for chunk in at_once]
    np.testing.assert_allclose(np.concatenate(audio), np.concatenate(at_once), atol=1e-4)
    assert _stats(decoder)["awaiting_sentences"] == 0


def test_a_stream_cancelled_while_its_later_sentences_are_encoded_frees_everything(decoder: Any) -> None:
    encoder = serve.get_deployment_handle("Encoder", APP)
    first, plan = encoder.encode_first.remote(_request(PARAGRAPH, seed=22), "first", EVERYONE).result()
    later = encoder.encode_planned.remote(plan, 1).result()
    before = _stats(decoder)
    held, _, chunks = _held_stream(decoder, first, later, "left")
    try:
        assert len(next(chunks)) > 0
        chunks.cancel()
        stats = lambda: _stats(decoder)  # noqa: E731
        wait_until(lambda: stats()["live"] == 0 and stats()["awaiting_sentences"] == 0, 30, "the request to go")
        assert stats()["cancelled"] == before["cancelled"] + 1 and stats()["queued"] == 0
    finally:
        held.open.remote()


def test_a_refused_later_sentence_ends_the_stream_with_its_error(decoder: Any) -> None:
    encoder = serve.get_deployment_handle("Encoder", APP)
    first, plan = encoder.encode_first.remote(_request(TOO_LONG_LATER, seed=23, ratio=10), "first", EVERYONE).result()
    later = encoder.encode_planned.remote(plan, 1).result()
    assert plan.num_segments == 2
    held, _, chunks = _held_stream(decoder, first, later, "refused")
    held.open.remote()
    with pytest.raises(Exception) as raised:
        list(chunks)
    assert isinstance(engine_error(raised.value), RequestTooLargeError), raised.value
    wait_until(lambda: _stats(decoder)["awaiting_sentences"] == 0 and _stats(decoder)["live"] == 0, 30, "an idle loop")


def test_a_streamed_request_over_http_is_the_audio_of_its_sentences_sent_at_once(base_url: str, decoder: Any) -> None:
    body = {"text": PARAGRAPH, "voice": "dummy_female", "format": "pcm", "stream": True, "seed": 24}
    with httpx.Client(base_url=base_url, timeout=120) as http:
        response = http.post("/v1/tts", json={**body, "sampling": {"max_token_text_ratio": 3.0}})
    assert response.status_code == 200, response.text
    streamed = np.frombuffer(response.content, dtype=np.int16).astype(np.float32) / PCM_MAX
    request = _request(PARAGRAPH, seed=24)
    segments = serve.get_deployment_handle("Encoder", APP).encode.remote(request, "at-once", EVERYONE).result()
    at_once = np.concatenate(list(decoder.stream.options(stream=True).remote(segments, "at-once")))
    assert len(streamed) == len(at_once)
    np.testing.assert_allclose(streamed, np.clip(at_once, -1, 1), atol=2e-4)  # as 16-bit samples


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_later_sentence_over_http_is_its_413(base_url: str, decoder: Any, stream: bool) -> None:
    body = {"text": TOO_LONG_LATER, "voice": "dummy_female", "format": "wav", "stream": stream}
    body["sampling"] = {"min_token_text_ratio": 1.0, "max_token_text_ratio": 10.0}
    with httpx.Client(base_url=base_url, timeout=120) as http, http.stream("POST", "/v1/tts", json=body) as response:
        if response.status_code == 200:  # a stream whose first chunk went out before the refusal: it is cut
            assert stream
            with pytest.raises(httpx.HTTPError):
                response.read()
            return
        response.read()
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "RequestTooLargeError" and "budget" in error["message"]
    wait_until(lambda: _stats(decoder)["awaiting_sentences"] == 0 and _stats(decoder)["live"] == 0, 30, "an idle loop")


# --- last: it kills the decoder replica ---------------------------------------------------------------------


def test_healthz_turns_503_soon_after_the_last_decoder_replica_dies_and_200_when_replaced(base_url: str) -> None:
    healthz = lambda: httpx.get(f"{base_url}/healthz", timeout=10).status_code  # noqa: E731
    assert healthz() == 200
    prefix = f"SERVE_REPLICA::{APP}#Decoder#"
    [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    # Serve's controller sees the death only at its next health check (~10 s here); the ingress, within a second or
    # two (the bound is generous: the machine is shared)
    wait_until(lambda: healthz() == 503, 5, "/healthz to answer 503 after the decoder died", interval_s=0.1)
    wait_until(lambda: healthz() == 200, 120, "/healthz to answer 200 once the replacement runs", interval_s=0.5)
