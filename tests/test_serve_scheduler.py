"""The Decoder deployment's continuous-batching loop on a real Serve app (tiny model): a request that arrives
while another decodes joins its LLM batch, whole and streaming requests share one model copy and one loop,
a cancelled stream frees its slot, an idle replica admits without waiting for an admission batch to fill, and
a request that can never fit the memory budget is refused with 413."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ray import serve
from serve_testing import running_app, wait_until

from engine.pipeline import EncodedSegment, SynthesisRequest
from engine.sampling import SamplingOptions
from serve_app.args import DecoderArgs
from serve_app.voice_registry import EVERYONE

APP = "scheduler"
BUDGET_GB = 0.3  # the tiny model's long stream below needs ~160 MiB; the 29-token sentence at 100 per token ~660


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    args = {
        "ingress": {"num_cpus": 0.1},
        "encoder": {"num_cpus": 0.1},
        "decoder": {"num_cpus": 0.2, "memory_budget_gb": BUDGET_GB},
    }
    with running_app(args, APP) as url:
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
    assert len(next(chunks)) > 0  # the long stream is decoding: about 1350 tokens, the first chunk at 120
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


def test_an_idle_replica_admits_at_once_and_a_busy_one_gathers_arrivals(decoder: Any) -> None:
    wait_until(lambda: not _stats(decoder)["loop_busy"], 30, "an idle loop")
    assert _stats(decoder)["admission_wait_s"] == 0.0  # an admission batch of an idle loop waits for no other
    long_stream = _encode("A long streaming request keeps the loop busy.", ratio=100, seed=3)
    chunks = decoder.stream.options(stream=True).remote(long_stream, "busy")
    assert len(next(chunks)) > 0
    busy = _stats(decoder)
    assert busy["loop_busy"] and busy["admission_wait_s"] == DecoderArgs().batch_wait_timeout_s
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
