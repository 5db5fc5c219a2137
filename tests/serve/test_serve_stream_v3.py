"""CosyVoice3 streaming through the served app (Ray Serve, CPU): `POST /v1/tts` with `stream: true` and OpenAI's
streamed `/v1/audio/speech`, and the speed rule (streamed at 1.0 only; OpenAI answers another speed whole).

Served model: the v3 kit's model dir, whose greedy LLM gives a known token count; its text holds `<|endofprompt|>`,
so it is taken as written (no system prompt added) and the engine's stream can be compared with the served one."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets

pytest.importorskip("ray")
import ray
from ray import serve

from deployments.text_relay import RELAY_NAME_PREFIX
from engine.llm.sampling import SamplingOptions
from engine.runtime.pipeline import CosyVoice
from engine.runtime.synthesis_request import SynthesisRequest
from tests.serve.conftest import TEXT_STREAM_PATH, on_cpus, running_app, wait_until

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

APP = "v3-stream"
KIT_MODEL = Path(__file__).parents[1] / "fixtures" / "cosyvoice3-tiny" / "model"
TEXT = "Hi<|endofprompt|>a b c"  # greedy on the kit's LLM: 84 tokens at 12 per text token, 3 chunks
VOICE = "spk3_a"
GREEDY = {"greedy": True, "min_token_text_ratio": 1.0, "max_token_text_ratio": 12.0}
HOP = 480
SLOTS_BACK_S = 10.0  # generous: the ingress cancels a left client's decoder call at once


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    args = {
        "model": str(KIT_MODEL),
        "decoder": {"num_cpus": 0.2},
    }
    with running_app(args, APP, deployments=on_cpus(TTSIngress=0.1, Encoder=0.1)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=300) as http:
        yield http


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768


def test_native_tts_streams_the_engine_s_chunks(client: httpx.Client) -> None:
    body = {"text": TEXT, "voice": VOICE, "format": "pcm", "stream": True, "seed": 1, "sampling": GREEDY}
    pieces: list[bytes] = []
    with client.stream("POST", "/v1/tts", json=body) as response:
        assert response.status_code == 200, response.read()
        pieces.extend(piece for piece in response.iter_raw() if piece)
    assert len(pieces) > 1, "the three chunks should arrive as more than one piece"
    served = pcm(b"".join(pieces))
    tts = CosyVoice.load(str(KIT_MODEL))
    sampling = SamplingOptions(seed=1, **GREEDY)
    segments = tts.encoder.encode(SynthesisRequest(TEXT, VOICE, sampling=sampling))
    local = np.concatenate([out[0] for out in tts.decoder.open_stream(segments) if out[0] is not None])
    assert len(served) == len(local) == 2 * 84 * HOP
    np.testing.assert_allclose(served, local, atol=1e-4, rtol=0)  # int16 rounding: measured 2.2e-5


def test_openai_speech_streams_at_speed_1_and_is_sent_whole_at_another(client: httpx.Client) -> None:
    body = {"model": KIT_MODEL.name, "input": TEXT, "voice": VOICE, "response_format": "pcm"}
    with client.stream("POST", "/v1/audio/speech", json=body) as response:
        assert response.status_code == 200, response.read()
        assert "content-length" not in response.headers  # a streamed body
        streamed = b"".join(response.iter_bytes())
    assert len(streamed) % (2 * HOP) == 0  # whole frames of 16-bit samples (the sampled length varies)
    whole = client.post("/v1/audio/speech", json={**body, "speed": 1.5})
    assert whole.status_code == 200 and int(whole.headers["content-length"]) == len(whole.content)


def test_native_streaming_at_another_speed_is_a_400(client: httpx.Client) -> None:
    body = {"text": TEXT, "voice": VOICE, "format": "pcm", "stream": True, "speed": 1.5}
    response = client.post("/v1/tts", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("CosyVoice3 streams at speed 1.0 only")


TEXT_STREAM = "Hello there, this text is written a few words at a time, as a language model writes it."  # one sentence


async def bistream_session(url: str, pause_s: float) -> tuple[float | None, float, bytes, dict[str, Any]]:
    """A WebSocket session sending TEXT_STREAM a word every `pause_s`, then end -> (seconds to the first audio frame,
    seconds to the end message, the audio, the done event)."""
    async with websockets.connect(url.replace("http://", "ws://", 1) + "/v1/audio/speech/stream") as ws:
        start = time.perf_counter()
        await ws.send(json.dumps({"type": "start", "model": KIT_MODEL.name, "voice": VOICE, "response_format": "pcm"}))
        audio: list[bytes] = []
        first: list[float] = []

        async def receive() -> dict[str, Any]:
            async for frame in ws:
                if isinstance(frame, bytes):
                    first.append(first[0] if first else time.perf_counter() - start)
                    audio.append(frame)
                else:
                    return json.loads(frame)
            raise AssertionError("closed without an event")

        events = asyncio.create_task(receive())
        for word in TEXT_STREAM.split(" "):
            await ws.send(json.dumps({"type": "text", "text": word + " "}))
            await asyncio.sleep(pause_s)
        end = time.perf_counter() - start
        await ws.send(json.dumps({"type": "end"}))
        done = await asyncio.wait_for(events, 300)
    return (first[0] if first else None), end, b"".join(audio), done


def test_the_text_stream_bistreams_text_as_it_comes(base_url: str) -> None:
    """CosyVoice3: the deltas' ids join the LLM as they come (no sentence buffering): audio before the end."""
    first, end, audio, done = asyncio.run(bistream_session(base_url, pause_s=0.4))
    assert done["type"] == "speech.audio.done", done
    assert first is not None and first < end, (first, end)
    assert len(audio) % 2 == 0 and np.isfinite(pcm(audio)).all() and len(audio) > 2 * HOP
    assert done["usage"]["input_tokens"] > 0 and done["usage"]["output_tokens"] > 0


async def left_and_refused(url: str) -> dict[str, Any]:
    """A session whose client leaves mid-text, then one with nothing to speak -> the latter's error event."""
    stream_url = url.replace("http://", "ws://", 1) + "/v1/audio/speech/stream"
    start = json.dumps({"type": "start", "model": KIT_MODEL.name, "voice": VOICE, "response_format": "pcm"})
    async with websockets.connect(stream_url) as ws:
        await ws.send(start)
        await ws.send(json.dumps({"type": "text", "text": "Leaving before the end of this "}))
        await asyncio.sleep(0.5)
    async with websockets.connect(stream_url) as ws:
        for message in (start, json.dumps({"type": "text", "text": "..."}), json.dumps({"type": "end"})):
            await ws.send(message)
        return json.loads(await asyncio.wait_for(ws.recv(), 60))


def test_a_bistream_session_left_or_refused_ends_cleanly(base_url: str) -> None:
    event = asyncio.run(left_and_refused(base_url))
    assert event["type"] == "error" and "nothing to speak" in event["error"]["message"], event
    first, _, audio, done = asyncio.run(bistream_session(base_url, pause_s=0.0))  # and the next one is spoken
    assert done["type"] == "speech.audio.done" and first is not None and audio


def decoder_stats() -> dict[str, Any]:
    return serve.get_deployment_handle("Decoder", APP).batch_stats.remote().result(timeout_s=60)


async def abandoned(url: str, stage: str) -> None:
    """A session whose client leaves at `stage`: right after start, after one piece, or once its audio flows."""
    start = {"type": "start", "model": KIT_MODEL.name, "voice": VOICE, "response_format": "pcm"}
    words = [{"type": "text", "text": word + " "} for word in TEXT_STREAM.split(" ")]
    async with websockets.connect(url.replace("http://", "ws://", 1) + TEXT_STREAM_PATH) as ws:
        await ws.send(json.dumps(start))
        if stage == "after start":
            await asyncio.sleep(0.05)
            return
        await ws.send(json.dumps(words[0]))
        if stage == "after one piece":
            await asyncio.sleep(0.3)
            return
        for message in [*words[1:], {"type": "end"}]:
            await ws.send(json.dumps(message))
        while not isinstance(frame := await asyncio.wait_for(ws.recv(), 120), bytes):  # mid-audio: its first frame
            raise AssertionError(f"an event before any audio: {frame}")


def test_abandoned_sessions_give_every_bistream_slot_back_and_leave_the_neighbour_alone(
    base_url: str, client: httpx.Client
) -> None:
    """A client that left 20-200 ms after start lost its decoder slot for good, and one that left mid-text left its
    decode running until the ceiling: the decoder's slots are a lease now, and the ingress cancels the call."""
    neighbour = {"text": TEXT, "voice": VOICE, "format": "pcm", "seed": 1, "sampling": GREEDY}
    quiet = client.post("/v1/tts", json=neighbour).content
    full = decoder_stats()["max_batch_size"]

    async def abandon_all() -> None:
        stages = ["after start", "after one piece", "mid-audio"] * 2
        await asyncio.gather(*(abandoned(base_url, stage) for stage in stages))

    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(client.post, "/v1/tts", json=neighbour)
        asyncio.run(abandon_all())
        left_at = time.monotonic()
        assert beside.result().content == quiet  # seeded: the same audio, byte for byte
    wait_until(lambda: decoder_stats()["bistreams"] == 0, SLOTS_BACK_S, "every bi-stream slot to come back")
    print(f"bi-stream slots back {time.monotonic() - left_at:.2f} s after the last client left")
    assert decoder_stats()["max_batch_size"] == full
    _, _, audio, done = asyncio.run(bistream_session(base_url, pause_s=0.0))  # and the next one is spoken
    assert done["type"] == "speech.audio.done" and audio


def text_relays() -> list[dict[str, str]]:
    named = ray.util.list_named_actors(all_namespaces=True)
    return [actor for actor in named if actor["name"].startswith(RELAY_NAME_PREFIX)]


def kill_text_relay() -> None:
    [relay] = text_relays()  # one ingress replica, one relay
    ray.kill(ray.get_actor(relay["name"], namespace=relay["namespace"]))
    wait_until(lambda: not text_relays(), 30, "the killed relay to be dead")


def test_a_lost_text_relay_fails_its_sessions_alone_and_healthz_says_so_until_it_is_back(
    base_url: str, client: httpx.Client
) -> None:
    """A killed relay failed every text stream (1013) for over a minute while /healthz said 200."""
    asyncio.run(bistream_session(base_url, pause_s=0.0))  # the relay exists

    async def in_flight_when_the_relay_dies() -> tuple[list[dict[str, Any]], bytes, int | None]:
        start = {"type": "start", "model": KIT_MODEL.name, "voice": VOICE, "response_format": "pcm"}
        async with websockets.connect(base_url.replace("http://", "ws://", 1) + TEXT_STREAM_PATH) as ws:
            await ws.send(json.dumps(start))
            await ws.send(json.dumps({"type": "text", "text": "Hello there, "}))
            await asyncio.to_thread(kill_text_relay)
            await ws.send(json.dumps({"type": "text", "text": "this text comes after the relay died."}))
            await ws.send(json.dumps({"type": "end"}))
            events: list[dict[str, Any]] = []
            try:
                while True:
                    if isinstance(frame := await asyncio.wait_for(ws.recv(), 120), str):
                        events.append(json.loads(frame))
            except websockets.ConnectionClosed as closed:
                return events, b"", closed.rcvd.code if closed.rcvd else None

    events, _, code = asyncio.run(in_flight_when_the_relay_dies())
    assert code == 1013 and events[-1]["type"] == "error", events
    _, _, audio, done = asyncio.run(bistream_session(base_url, pause_s=0.0))  # the next session: a new relay
    assert done["type"] == "speech.audio.done" and audio, done
    kill_text_relay()  # with no session to notice: /healthz's probe does
    degraded = client.get("/healthz")
    assert degraded.status_code == 503 and degraded.json()["status"] == "degraded", degraded.text
    assert any("text relay" in warning for warning in degraded.json()["warnings"])
    wait_until(lambda: client.get("/healthz").status_code == 200, 30, "/healthz to answer 200 with a new relay")
    _, _, audio, done = asyncio.run(bistream_session(base_url, pause_s=0.0))
    assert done["type"] == "speech.audio.done" and audio


def decoder_replica() -> Any:
    prefix = f"SERVE_REPLICA::{APP}#Decoder#"
    [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return ray.get_actor(name, namespace="serve")


def test_a_text_stream_whose_decoder_dies_before_its_first_audio_is_spoken_by_the_replacement(
    base_url: str,
) -> None:
    """The relay keeps the session's pieces, so the utterance's call, sent again to the replacement replica, reads
    them from the first: the client sees its audio and the done event, as if nothing happened."""

    async def session_across_the_kill() -> tuple[bytes, dict[str, Any]]:
        start = {"type": "start", "model": KIT_MODEL.name, "voice": VOICE, "response_format": "pcm"}
        async with websockets.connect(base_url.replace("http://", "ws://", 1) + TEXT_STREAM_PATH) as ws:
            await ws.send(json.dumps(start))
            await ws.send(json.dumps({"type": "text", "text": "Hello "}))  # too short to speak: the LM waits
            await asyncio.to_thread(
                wait_until, lambda: decoder_stats()["bistreams"] == 1, 60, "the decoder to hold the utterance"
            )
            await asyncio.to_thread(ray.kill, decoder_replica(), no_restart=True)
            await ws.send(json.dumps({"type": "text", "text": "there, this text comes after the decoder died."}))
            await ws.send(json.dumps({"type": "end"}))
            audio: list[bytes] = []
            while isinstance(frame := await asyncio.wait_for(ws.recv(), 300), bytes):
                audio.append(frame)
            return b"".join(audio), json.loads(frame)

    audio, done = asyncio.run(session_across_the_kill())
    assert done["type"] == "speech.audio.done", done
    assert len(audio) > 2 * HOP and np.isfinite(pcm(audio)).all()
