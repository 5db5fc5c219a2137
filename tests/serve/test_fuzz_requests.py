"""Hostile and random requests against a local Serve of the tiny app: never a 5xx, never a broken stream, never a
failed decoder loop, and a stream running beside them completes whole.

Hypothesis draws both request bodies (native `/v1/tts` and OpenAI's `/v1/audio/speech`) with non-finite and extreme
numbers, huge integers, odd and long strings and unknown values, sent as raw JSON (Python's parser takes NaN,
Infinity and integers of any length, as a client may send them). Derandomized, so a CI run replays the same cases.
Known attacks (token-heavy text, lone surrogates, JSON nested too deep, on both HTTP APIs and the text stream
WebSocket) run beside a seeded stream, whose bytes must be those of a quiet run.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import serve

from serve_app.audio import FORMATS
from tests.serve.conftest import TEXT_STREAM_PATH, on_cpus, running_app, text_stream_exchange, wait_until

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

APP = "fuzz"
MAX_INPUT_CHARS = 200  # and so at most 300 tokens (1.5 a character): below the 399 of EMOJI_TEXT's
MAX_TEXT_STREAMS = 2
MAX_AUDIO_S = 3.0  # every accepted request is short: the fuzz run stays quick on CPU
EXAMPLES = 80


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    args = {
        "model": "tiny",
        "decoder": {"num_cpus": 0.5, "max_batch_size": 4},
        "limits": {
            "max_input_chars": MAX_INPUT_CHARS,
            "max_text_streams": MAX_TEXT_STREAMS,
            "max_audio_s": MAX_AUDIO_S,
            "max_stream_s": 60,
        },
    }
    with running_app(args, APP, deployments=on_cpus(TTSIngress=0.25, Encoder=0.25)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as http:
        yield http


def _decoder_stats() -> dict[str, Any]:
    return serve.get_deployment_handle("Decoder", APP).batch_stats.remote().result(timeout_s=60)


numbers = st.one_of(
    st.floats(min_value=0, max_value=1),  # often valid, so that requests reach the decoder too
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**60), max_value=10**60),
    st.sampled_from([0, 1, 2, -1, 0.5, 2**63, 2**64, 1e308, -1e-308, 100000]),
    st.booleans(),
    st.none(),
    st.text(max_size=5),
)
texts = st.one_of(
    st.sampled_from(["Hi.", "Hello there, how are you today?", "One. Two! Three?"]),
    st.text(max_size=60),  # any unicode, lone surrogates included
    st.text(alphabet="aeiou .,!?", min_size=1, max_size=MAX_INPUT_CHARS + 20),
    st.sampled_from(["", "   ", "<|endofprompt|>", "\x00", "[breath]", "a" * 10_000, "😀" * 50]),
    numbers,
)
voices = st.one_of(st.sampled_from(["dummy_female", "dummy_male", "alloy", "voice_0123456789ab", "../x"]), texts)
formats = st.one_of(st.sampled_from(sorted(FORMATS)), texts)
sampling = st.one_of(
    st.dictionaries(
        st.sampled_from(
            ["greedy", "top_p", "top_k", "win_size", "tau_r", "min_token_text_ratio", "max_token_text_ratio", "x"]
        ),
        numbers,
    ),
    numbers,
)
tts_bodies = st.fixed_dictionaries(
    {"text": texts},
    optional={
        "voice": voices,
        "format": formats,
        "stream": st.one_of(st.booleans(), numbers),
        "seed": numbers,
        "speed": numbers,
        "sampling": sampling,
        "instruct_text": texts,
        "cross_lingual": st.one_of(st.booleans(), numbers),
    },
)
speech_bodies = st.fixed_dictionaries(
    {"model": st.one_of(st.sampled_from(["tiny", "tts-1"]), texts), "input": texts, "voice": voices},
    optional={
        "response_format": formats,
        "speed": numbers,
        "stream_format": st.one_of(st.sampled_from(["audio", "sse"]), texts),
        "instructions": texts,
    },
)
requests = st.one_of(st.tuples(st.just("/v1/tts"), tts_bodies), st.tuples(st.just("/v1/audio/speech"), speech_bodies))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=requests)
def test_no_request_gets_a_5xx_breaks_a_stream_or_the_decoder_loop(
    client: httpx.Client, request: tuple[str, dict[str, Any]]
) -> None:
    path, body = request
    raw = json.dumps(body, allow_nan=True).encode()
    with client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as response:
        data = response.read()  # a stream cut after its status line raises here
    assert response.status_code < 500, (path, body, data[:300])
    if response.status_code >= 400:
        assert json.loads(data)["error"]["message"]
    stats = _decoder_stats()
    assert stats["loop_failed"] is False and stats["request_faults"] == 0, (path, body)


EMOJI_TEXT = "a" + "\U0001f600" * (MAX_INPUT_CHARS - 1)
DEEP_JSON = "[" * 100_000 + "]" * 100_000  # 200 KB: within the body limit, beyond the parser's depth
HOSTILE = [  # (path, raw body, status)
    ("/v1/tts", '{"text": "Hi.", "sampling": {"min_token_text_ratio": NaN}}', 400),
    ("/v1/tts", '{"text": "Hi.", "sampling": {"win_size": 1' + "0" * 400 + "}}", 400),
    ("/v1/tts", '{"text": "Hi.", "sampling": {"min_token_text_ratio": 100000, "max_token_text_ratio": 100000}}', 400),
    ("/v1/audio/speech", '{"model": "tiny", "input": "Hi.", "voice": "alloy", "speed": NaN}', 400),
    ("/v1/tts", json.dumps({"text": EMOJI_TEXT}), 413),
    ("/v1/audio/speech", '{"model": "tiny", "input": "Hi \\ud800.", "voice": "alloy"}', 400),
    ("/v1/tts", DEEP_JSON, 400),
]
START = {"type": "start", "model": "tiny", "voice": "alloy", "response_format": "pcm"}
HOSTILE_TEXT_STREAMS = [  # the messages of a session, and the code of its error event
    ([DEEP_JSON], "InvalidInputError"),
    (['{"type": "start", "model": ' + DEEP_JSON + "}"], "InvalidInputError"),
    ([START, '{"type": "text", "text": "Hello \\ud800 there."}'], "invalid_request"),
    ([START, {"type": "text", "text": EMOJI_TEXT}, {"type": "end"}], "TextTooLongError"),
]


def test_a_stream_beside_hostile_requests_completes_whole(base_url: str, client: httpx.Client) -> None:
    body = {"text": "A stream that runs while others attack.", "format": "pcm", "stream": True, "seed": 3}
    body["sampling"] = {"max_token_text_ratio": 5}  # within the app's MAX_AUDIO_S
    alone = client.post("/v1/tts", json=body)
    assert alone.status_code == 200 and alone.content

    def attack(path_raw: tuple[str, str, int]) -> int:
        path, raw, _ = path_raw
        return client.post(path, content=raw.encode(), headers={"content-type": "application/json"}).status_code

    with ThreadPoolExecutor(len(HOSTILE) + 1) as pool:
        streamed = pool.submit(client.post, "/v1/tts", json=body)
        statuses = list(pool.map(attack, HOSTILE))
        sessions = [asyncio.run(text_stream_exchange(base_url, messages)) for messages, _ in HOSTILE_TEXT_STREAMS]
        beside = streamed.result()
    assert statuses == [status for _, _, status in HOSTILE]
    for (events, audio, close_code), (_, error_code) in zip(sessions, HOSTILE_TEXT_STREAMS, strict=True):
        assert close_code == 1008 and not audio and events[-1]["error"]["code"] == error_code, events
    assert beside.status_code == 200 and beside.content == alone.content  # seeded: the same audio, byte for byte
    assert _decoder_stats()["loop_failed"] is False


async def idle_flushing_and_one_more(base_url: str, held: threading.Event, leave: threading.Event) -> int | None:
    """Every text stream slot held (`held` set then), one socket silent and one sending `flush` with nothing to speak
    every 0.1 s; one more socket -> its handshake's status (None if it opened). The held sockets leave once `leave`
    is set."""
    url = base_url.replace("http://", "ws://", 1) + TEXT_STREAM_PATH
    silent = await websockets.connect(url)
    flushing = await websockets.connect(url)
    await flushing.send(json.dumps(START))
    try:
        await websockets.connect(url)
        refused = None
    except websockets.InvalidStatus as exc:
        refused = exc.response.status_code
    held.set()
    while not leave.is_set():
        await flushing.send(json.dumps({"type": "flush"}))
        await asyncio.sleep(0.1)
    await silent.close()
    await flushing.close()
    return refused


def test_silent_and_flush_only_text_streams_never_take_the_slots_requests_need(
    base_url: str, client: httpx.Client
) -> None:
    """64 sockets that sent nothing held all 64 ingress slots (a neighbour got no answer in 20 s), and a flush every
    20 s kept them past the idle limit: text streams now have their own cap below the replica's slots, and only text
    to speak (or audio) keeps one open (the idle ending of a silent and of a flush-only stream:
    tests/serve/test_serve_units.py, with a short idle time; the app's is TEXT_STREAM_IDLE_S, a minute)."""
    body = {
        "text": "A request while sockets hold on.",
        "format": "pcm",
        "seed": 4,
        "sampling": {"max_token_text_ratio": 5},
    }
    quiet = client.post("/v1/tts", json=body)
    held, leave = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        sockets = pool.submit(asyncio.run, idle_flushing_and_one_more(base_url, held, leave))
        assert held.wait(60)
        beside = client.post("/v1/tts", json=body)  # answered while the sockets hold every text stream slot
        leave.set()
        refused = sockets.result()
    assert refused == 503  # the one over the cap, at its handshake
    assert beside.status_code == 200 and beside.content == quiet.content
    spoken: list[tuple[list[dict[str, Any]], bytes, int | None]] = []

    def spoken_once_a_slot_is_back() -> bool:
        """A text stream that speaks "Hi."; False while its handshake is refused with 503 (the sockets that just left
        free their slots as the ingress sees them go)."""
        try:
            spoken.append(
                asyncio.run(text_stream_exchange(base_url, [START, {"type": "text", "text": "Hi."}, {"type": "end"}]))
            )
        except websockets.InvalidStatus as exc:
            if exc.response.status_code != 503:
                raise
            return False
        return True

    wait_until(spoken_once_a_slot_is_back, 10, "a text stream slot once the held sockets left", interval_s=0.2)
    events, audio, code = spoken[-1]
    assert code == 1000 and audio and events[-1]["type"] == "speech.audio.done"  # their slots came back
