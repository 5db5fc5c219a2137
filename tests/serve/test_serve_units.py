"""Serve-side pieces that need no Ray cluster: device choice, error mapping, typed app arguments, the ingress's
calls of a stream."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fastapi import WebSocketDisconnect
from pydantic import ValidationError
from ray.exceptions import (
    ObjectReconstructionFailedError,
    RayActorError,
    RayTaskError,
    TaskCancelledError,
)
from ray.serve.exceptions import BackPressureError

from autoscaling.metrics import ReplicaLoadTracker
from deployments.decoder import resolve_device_and_dtype
from deployments.encoder import VoiceCloningNotConfiguredError
from deployments.loop_bridge import LoopBridge
from deployments.text_relay import TextSessionClosedError
from engine.errors import (
    CosyVoiceError,
    DecodeLimitError,
    InvalidInputError,
    NonFiniteOutputError,
    UnavailableError,
    UnknownVoiceError,
    as_request_error,
)
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import PRESET_VOICE_MODELS
from engine.loading.model_source import served_name
from engine.runtime.pipeline import CosyVoice
from engine.runtime.scheduler import Scheduler
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.speaker_bank import DUMMY_VOICES
from serve_app.args import AppArgs
from serve_app.cli_run import with_default_voices_dir
from serve_app.decoder_args import DecoderArgs
from serve_app.errors import StreamIdleError, error_payload, unavailable_error
from serve_app.native_routes import default_voice
from serve_app.openai_routes import served_model
from serve_app.request_args import OPENAI_VOICE_NAMES, LimitsArgs, OpenAIArgs
from serve_app.responses import speech_usage
from serve_app.schemas import StreamFlush
from serve_app.speech_stream_routes import SpeechStreamRoutes
from serve_app.synthesis import Synthesis, call, check_streams, delivery
from serve_app.text_stream import TextStream, TextStreamSlots, close_code, error_event
from serve_app.voice_names import mapped_voice
from tests.engine.conftest import CACHED_COMMIT, REPO_ID, V3_KIT_MODEL, hugging_face_cache
from tests.serve.conftest import model_info


@pytest.fixture
def serve_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """`caplog` with what Serve's logger logs from INFO up (it does not propagate to the root logger)."""
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addHandler(caplog.handler)
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        yield caplog
    serve_logger.removeHandler(caplog.handler)


def test_cpu_replica_keeps_the_dtype_asked_auto_chosen_at_load() -> None:
    # on CPU, `auto` stays `auto`: the loader chooses each stage's precision at load
    assert resolve_device_and_dtype(use_gpu=False, dtype="auto") == ("cpu", "auto")
    assert resolve_device_and_dtype(use_gpu=False, dtype="bfloat16") == ("cpu", "bfloat16")


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (InvalidInputError("bad speed"), 400),
        (UnknownVoiceError("no voice"), 404),
        (VoiceCloningNotConfiguredError(), 501),
    ],
)
def test_engine_errors_map_to_openai_error_bodies(error: CosyVoiceError, status: int) -> None:
    for raised in (error, RayTaskError("encode", "traceback", error)):  # as it arrives from another replica
        got_status, body = error_payload(raised, "req-7")
        assert got_status == status
        expected = error.message if status < 500 else f"{error.message} (request id req-7)"
        assert body["error"]["message"] == expected
        assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")
        assert body["error"]["code"] == type(error).__name__


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RuntimeError("boom at /secret/path"), "internal_error"),
        (NonFiniteOutputError("nan in the flow"), "NonFiniteOutputError"),
    ],
)
def test_500s_say_internal_error_and_log_the_traceback_with_the_request_id(
    error: Exception, code: str, serve_log: pytest.LogCaptureFixture
) -> None:
    try:
        raise error
    except Exception as raised:
        status, body = error_payload(RayTaskError("decode", "traceback", raised), "req-9")
    assert status == 500
    assert body["error"] == {
        "message": "internal error (request id req-9)",
        "type": "server_error",
        "code": code,
        "param": None,
    }
    [record] = [r for r in serve_log.records if r.getMessage() == "internal error"]
    assert record.request_id == "req-9" and record.exc_info is not None


def test_app_args_defaults_and_validation() -> None:
    args = AppArgs.model_validate({"model": "tiny", "decoder": {"max_batch_size": 8}})
    assert args.decoder.num_gpus == 0 and args.decoder.ongoing_requests_limit >= 8
    with pytest.raises(ValidationError, match=r"max_ongoing_requests was removed: set .* of deployment `Decoder`"):
        DecoderArgs(max_batch_size=8, max_ongoing_requests=4)
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"decoder": {"num_gpus": 1.5}})
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"modle": "tiny"})


def test_tiny_presets_use_their_shipped_cloning_models() -> None:
    for preset in ("tiny", "cosyvoice2-tiny"):
        args = AppArgs.model_validate({"model": preset, "voices_dir": "/tmp/voices"})
        assert args.voice_models_source == str(PRESET_VOICE_MODELS[preset])
        assert (PRESET_VOICE_MODELS[preset] / "campplus.onnx").is_file()
    with pytest.raises(ValidationError, match="needs voice_models_dir"):
        AppArgs.model_validate({"model": "cosyvoice2-0.5b", "voices_dir": "/tmp/voices"})
    assert AppArgs(model="/models/CosyVoice-300M").voice_models_source == "/models/CosyVoice-300M"
    # a hub id's cloning models are in its directory, resolved where the encoder runs
    hub = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
    assert AppArgs(model=hub).voice_models_source == hub


def test_models_by_hub_id_and_the_llm_checkpoint_in_the_app_args() -> None:
    assert AppArgs(model="FunAudioLLM/Fun-CosyVoice3-0.5B-2512").llm_checkpoint == "auto"
    assert AppArgs(llm_checkpoint="llm.pt").llm_checkpoint == "llm.pt"
    for bad in ("../llm.pt", "llm", "/models/llm.pt"):
        with pytest.raises(ValidationError, match="llm_checkpoint"):
            AppArgs(llm_checkpoint=bad)
    with pytest.raises(ValidationError, match=r"a hub id, but security\.allowed_model_roots admits only directories"):
        AppArgs.model_validate(
            {"model": "FunAudioLLM/Fun-CosyVoice3-0.5B-2512", "security": {"allowed_model_roots": ["/models"]}}
        )


def test_with_model_roots_a_hub_model_is_named_by_its_snapshot_in_the_cache(tmp_path: Path) -> None:
    """docs/deploy.md: roots admit directories, so the id is replaced by the snapshot directory `cosyvoice-serve
    download` prints, inside the cache's hub folder, and the served name is set (the directory's is the commit)."""
    snapshot = hugging_face_cache(tmp_path, REPO_ID, V3_KIT_MODEL)
    args = AppArgs.model_validate(
        {
            "model": str(snapshot),
            "served_model_name": "Fun-CosyVoice3-0.5B-2512",
            "security": {"allowed_model_roots": [str(tmp_path / "hub")]},
        }
    )
    assert args.model == str(snapshot) and served_name(args.model) == CACHED_COMMIT


def test_openai_args_cover_every_openai_voice_for_the_presets() -> None:
    openai = AppArgs().openai
    assert set(openai.voices) == set(OPENAI_VOICE_NAMES)
    assert set(openai.voices.values()) <= set(DUMMY_VOICES)  # the built-in speakers of every preset
    with pytest.raises(ValidationError, match="non-empty"):
        AppArgs.model_validate({"openai": {"voices": {"alloy": " "}}})


def test_run_gives_the_tiny_model_a_per_user_voices_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert with_default_voices_dir({})["voices_dir"] == str(tmp_path / "cosyvoice-serve" / "voices" / "tiny")
    assert with_default_voices_dir({"voices_dir": "/elsewhere"})["voices_dir"] == "/elsewhere"
    # A model dir without campplus.onnx keeps cloning off rather than failing at start.
    assert "voices_dir" not in with_default_voices_dir({"model": str(tmp_path)})


def test_openai_voice_names_map_through_the_table() -> None:
    table = {"alloy": "speaker_a", "nova": "voice_0123456789ab", "echo": "gone", "speaker_b": "speaker_a"}
    built_in = ["speaker_a", "speaker_b"]
    assert mapped_voice("alloy", table, built_in) == "speaker_a"
    assert mapped_voice("nova", table, built_in) == "voice_0123456789ab"  # a registered voice
    assert mapped_voice("speaker_b", table, built_in) == "speaker_b"  # a built-in name wins over the table
    assert mapped_voice("voice_fedcba987654", table, built_in) == "voice_fedcba987654"
    with pytest.raises(UnknownVoiceError, match=r"'echo' stands for 'gone'.*its voices: speaker_a, speaker_b"):
        mapped_voice("echo", table, built_in)


V2_INFO = model_info(family="CosyVoice2", streaming=True, streaming_speed=True)
V3_INFO = model_info(family="CosyVoice3", streaming=True, streaming_speed=False)  # speed only when whole
NO_STREAMS = model_info(family="Future", streaming=False, streaming_speed=False)


def test_a_streamed_request_the_family_cannot_stream_is_a_400() -> None:
    check_streams(V2_INFO, 1.5)
    check_streams(V3_INFO, 1.0)
    with pytest.raises(InvalidInputError, match=r"^Future models cannot stream yet: send the request with stream"):
        check_streams(NO_STREAMS, 1.0)
    with pytest.raises(InvalidInputError, match=r"^CosyVoice3 streams at speed 1.0 only, as the official code"):
        check_streams(V3_INFO, 1.5)


def test_openai_speech_is_sent_whole_where_the_format_or_the_family_cannot_stream() -> None:
    def answer(asked: str, fmt: str, info: Any, speed: float) -> tuple[str, bool]:
        decided = delivery(asked, fmt, info, speed)
        return decided.mode, decided.streamed

    assert answer("audio", "mp3", V2_INFO, 1.0) == ("stream", True)
    assert answer("audio", "flac", V2_INFO, 1.0) == ("whole", False)
    assert answer("audio", "mp3", NO_STREAMS, 1.0) == ("whole", False)
    assert answer("sse", "mp3", NO_STREAMS, 1.0) == ("sse", False)  # one event at the end
    assert answer("sse", "flac", V2_INFO, 1.0) == ("sse", False)
    assert answer("sse", "mp3", V2_INFO, 1.0) == ("sse", True)
    assert answer("audio", "mp3", V2_INFO, 1.5) == ("stream", True)  # v1/v2 stretch each chunk
    assert answer("audio", "mp3", V3_INFO, 1.0) == ("stream", True)
    assert answer("audio", "mp3", V3_INFO, 1.5) == ("whole", False)  # CosyVoice3 applies speed to whole requests only
    assert answer("whole", "mp3", V2_INFO, 1.0) == ("whole", False)
    assert answer("stream", "mp3", V2_INFO, 1.0) == ("stream", True)
    with pytest.raises(InvalidInputError, match="cannot be streamed"):
        delivery("stream", "flac", V2_INFO, 1.0)
    with pytest.raises(InvalidInputError, match=r"streams at speed 1\.0 only"):
        delivery("stream", "mp3", V3_INFO, 1.5)


def test_mps_thread_share_gives_each_gpu_replica_its_share_of_the_sms_before_cuda_starts() -> None:
    from ray.serve._private.build_app import build_app as build_deployments

    from serve_app.ingress import build_app

    def decoder_options(decoder: dict) -> dict:
        app = build_app({"model": "tiny", "decoder_cpu": {"enabled": False}, "decoder": decoder})
        [built] = [d for d in build_deployments(app, name="app").deployments if d.name == "Decoder"]
        return built.ray_actor_options

    assert "runtime_env" not in decoder_options({"num_gpus": 0.25})  # off by default
    options = decoder_options({"num_gpus": 0.25, "mps_thread_share": True})
    assert options["num_gpus"] == 0.25
    assert options["runtime_env"]["env_vars"] == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    with pytest.raises(ValidationError, match="num_gpus > 0"):
        DecoderArgs(mps_thread_share=True)


def test_the_scheduler_app_args_make_the_decoder_loops_policy() -> None:
    from engine.runtime.playback import DeadlinePolicy, FcfsPolicy
    from serve_app.args import AppArgs

    def policy_of(args: AppArgs) -> object:  # what build_app hands each Decoder
        return args.scheduler.decoder_policy()

    assert policy_of(AppArgs()) == DeadlinePolicy()
    args = AppArgs.model_validate({"scheduler": {"policy": "deadline", "target_first_audio_s": 3.0}})
    assert policy_of(args) == DeadlinePolicy(target_first_audio_s=3.0)
    assert isinstance(policy_of(AppArgs.model_validate({"scheduler": {"policy": "fcfs"}})), FcfsPolicy)
    with pytest.raises(ValueError, match="policy"):
        AppArgs.model_validate({"scheduler": {"policy": "lifo"}})


class _FakeCall:
    """A deployment call: a unary one (`_to_object_ref`) or a streamed one (its chunks); records `cancel`."""

    def __init__(self, chunks: list[np.ndarray] | None = None) -> None:
        self.chunks = list(chunks or [])
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    async def _to_object_ref(self) -> str:
        return "reference to the later sentences"

    def __aiter__(self) -> _FakeCall:
        return self

    async def __anext__(self) -> np.ndarray:
        if not self.chunks:
            raise StopAsyncIteration
        return self.chunks.pop(0)


@pytest.mark.parametrize("sentences", [1, 3])
def test_a_stream_whose_client_leaves_cancels_the_decoders_call_and_the_encoders_call_for_the_rest(
    sentences: int,
) -> None:
    rest, stream, sent = _FakeCall(), _FakeCall([np.ones(4, np.float32)] * 2), {}
    encoder = SimpleNamespace(encode_planned=SimpleNamespace(remote=lambda plan, start, request_id: rest))

    def stream_remote(first: list[str], request_id: str, later: list[str]) -> _FakeCall:
        sent.update(first=first, later=later)
        return stream

    decoder = SimpleNamespace(stream=SimpleNamespace(options=lambda stream: SimpleNamespace(remote=stream_remote)))
    synthesis = Synthesis(encoder, SimpleNamespace(handle=lambda: decoder), "tiny", LimitsArgs(), OpenAIArgs())

    async def first_chunk_then_leave() -> None:
        plan = SimpleNamespace(num_segments=sentences)
        chunks = synthesis.stream_audio(["first sentence"], plan, "req-1")
        assert len(await anext(chunks)) == 4
        await chunks.aclose()  # the client left

    asyncio.run(first_chunk_then_leave())
    later = ["reference to the later sentences"] if sentences > 1 else []
    assert sent == {"first": ["first sentence"], "later": later}  # at once, the later sentences still encoding
    assert stream.cancelled and rest.cancelled == (sentences > 1)


def test_a_stream_whose_later_sentences_fail_ends_with_the_encoders_error_or_a_503() -> None:
    from deployments.loop_bridge import later_sentences_error
    from engine.errors import RequestFailedError

    refused = InvalidInputError("the text is too long")
    assert later_sentences_error(RayTaskError("encode_planned", "traceback", refused)) is refused
    for lost in (RayActorError(), TaskCancelledError(), _lost_with_its_node()):
        assert isinstance(later_sentences_error(lost), UnavailableError)
    bug = RuntimeError("a bug in the encoder")
    failed = later_sentences_error(RayTaskError("encode_planned", "traceback", bug))
    assert isinstance(failed, RequestFailedError) and failed.__cause__ is not None  # logged by the decoder, a 500


ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


@pytest.mark.parametrize(
    ("name", "stands_for"),
    [
        ("tiny", "tiny"),
        ("tts-1-hd", "tts-1-hd"),
        ("gpt-4o-mini-tts-2025-12-15", "gpt-4o-mini-tts"),
        ("tts-1-1106", "tts-1"),
        ("tts-1-hd-1106", "tts-1-hd"),
        ("tiny-1106", None),  # the served model's own name takes no snapshot suffix: it names no OpenAI model
        ("tts-1-11060", None),
        ("tts-2", None),
        ("gpt-4o-mini-tts-2025-12", None),
    ],
)
def test_an_alias_with_a_snapshot_suffix_is_that_alias(name: str, stands_for: str | None) -> None:
    assert served_model(name, "tiny", ALIASES) == stands_for


def test_speech_usage_counts_text_tokens_and_the_audio_in_speech_tokens() -> None:
    assert speech_usage(12, 2.0, 25) == {"input_tokens": 12, "output_tokens": 50, "total_tokens": 62}


def test_a_503_says_our_message_and_logs_serves_text(serve_log: pytest.LogCaptureFixture) -> None:
    serve_text = BackPressureError(num_queued_requests=64, max_queued_requests=64)
    status, body = error_payload(serve_text, "req-9")
    assert status == 503
    assert body["error"]["message"] == "the server is at capacity; retry later (request id req-9)"
    assert "64" in serve_log.text  # Serve's own words stay in the log
    assert unavailable_error(ValueError("not Serve's")) is None


def _lost_with_its_node() -> ObjectReconstructionFailedError:
    """What awaiting a result raises once the node that held it is gone (an ObjectLostError)."""
    return ObjectReconstructionFailedError("ab" * 28, None, "")


class _FailingCall(_FakeCall):
    """A streamed call that fails before its first chunk."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def __anext__(self) -> np.ndarray:
        raise self.error


def test_a_stream_whose_first_chunks_were_lost_with_the_decoders_node_is_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node lost under a stream: the decoder's chunks that lived in its object store cannot be fetched
    (ObjectReconstructionFailedError, not a RayActorError); a stream that sent nothing yet goes again."""
    from serve_app import synthesis

    monkeypatch.setattr(synthesis, "REROUTE_BACKOFF_S", 0.0)
    calls = [_FailingCall(_lost_with_its_node()), _FakeCall([np.ones(4, np.float32)] * 2)]
    tried = []

    def stream_remote(first: list[str], request_id: str, later: list[str]) -> _FakeCall:
        tried.append(first)
        return calls[len(tried) - 1]

    decoder = SimpleNamespace(stream=SimpleNamespace(options=lambda stream: SimpleNamespace(remote=stream_remote)))
    router = SimpleNamespace(handle=lambda: decoder)
    synthesis = Synthesis(None, router, "tiny", LimitsArgs(), OpenAIArgs())

    async def all_chunks() -> list[np.ndarray]:
        plan = SimpleNamespace(num_segments=1)
        return [c async for c in synthesis.stream_audio(["first sentence"], plan, "req-1")]

    assert len(asyncio.run(all_chunks())) == 2
    assert tried == [["first sentence"]] * 2


@pytest.mark.parametrize("lost_after_audio", [False, True])
def test_a_text_stream_whose_decoder_is_lost_before_its_first_audio_is_sent_again(
    monkeypatch: pytest.MonkeyPatch, lost_after_audio: bool
) -> None:
    """The bi-streamed utterance's call goes again (the relay replays the session's pieces to it) while it has sent
    no audio; lost after its first audio, the session ends with 503 (1013), as a stream does."""
    from serve_app import synthesis
    from serve_app.errors import ServiceUnavailableError

    monkeypatch.setattr(synthesis, "REROUTE_BACKOFF_S", 0.0)
    chunk = np.ones(4, np.float32)

    class _LostAfterItsChunks(_FakeCall):
        async def __anext__(self) -> np.ndarray:
            if self.chunks:
                return self.chunks.pop(0)
            raise RayActorError()

    calls = [_LostAfterItsChunks([chunk] if lost_after_audio else []), _FakeCall([chunk, chunk])]
    tried = []

    def bistream_remote(*args: Any) -> _FakeCall:
        tried.append(args)
        return calls[len(tried) - 1]

    decoder = SimpleNamespace(bistream=SimpleNamespace(options=lambda stream: SimpleNamespace(remote=bistream_remote)))
    routes = SimpleNamespace(
        synthesis=Synthesis(None, SimpleNamespace(handle=lambda: decoder), "tiny", LimitsArgs(), OpenAIArgs())
    )
    sent: list[bytes] = []

    async def send_bytes(data: bytes) -> None:
        sent.append(data)

    stream = SimpleNamespace(ws=SimpleNamespace(send_bytes=send_bytes), active=lambda: None)
    encoder = SimpleNamespace(encode=lambda audio: audio.tobytes(), finish=lambda: b"")
    timer = SimpleNamespace(audio=lambda audio: None)
    speak = SpeechStreamRoutes.speak_relayed(routes, stream, "start", "relay", "s", encoder, timer, "req-1")
    if lost_after_audio:
        with pytest.raises(ServiceUnavailableError):
            asyncio.run(speak)
        assert len(tried) == 1 and len(sent) == 1
    else:
        asyncio.run(speak)
        assert tried == [("start", "relay", "s", "req-1")] * 2 and len(sent) == 2


def test_a_call_whose_result_was_lost_with_its_node_is_retried_once_then_503() -> None:
    from serve_app.errors import ServiceUnavailableError

    outcomes: list[Exception | str] = [_lost_with_its_node(), "audio"]

    async def make_call() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert asyncio.run(call(make_call)) == "audio"
    outcomes[:] = [_lost_with_its_node(), _lost_with_its_node()]
    with pytest.raises(ServiceUnavailableError, match="a replica failed"):
        asyncio.run(call(make_call))
    status, body = error_payload(_lost_with_its_node(), "req-1")
    assert status == 503 and "replica failed" in body["error"]["message"]


def test_a_request_without_voice_to_a_model_without_speakers_takes_the_default_voice_else_is_a_400() -> None:
    speakers = model_info(voices=("dummy_female",), default_voice="voice_0123456789ab")
    assert default_voice(speakers) == "dummy_female"
    assert default_voice(model_info(default_voice="voice_0123456789ab")) == "voice_0123456789ab"
    with pytest.raises(InvalidInputError, match="no built-in speakers: pass `voice`"):
        default_voice(model_info())  # CosyVoice3 with default_voice off: registered voices only


class _SilentSocket:
    """A WebSocket whose client connected and then sends nothing (nor leaves)."""

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def test_a_silent_text_stream_ends_after_the_idle_time_but_not_while_its_audio_is_made() -> None:
    async def run() -> None:
        stream = TextStream(_SilentSocket(), max_frame_bytes=1000, idle_s=0.05)
        stream.pending = 1  # a sentence is being spoken: the client may wait for its audio
        waiting = asyncio.ensure_future(stream.next_message())
        await asyncio.sleep(0.3)
        assert not waiting.done()
        stream.pending = 0
        with pytest.raises(StreamIdleError, match="no audio in the making"):
            await asyncio.wait_for(waiting, 1.0)
        stream.close()

    asyncio.run(run())
    status, event = error_event(StreamIdleError("idle"), "req-1")
    assert status == 408 and event["type"] == "error" and event["error"]["code"] == "StreamIdleError"
    assert close_code(status) == 1008 and close_code(503) == 1013 and close_code(500) == 1011


class _FlushingSocket:
    """A WebSocket whose client sends `flush` (with nothing to speak) every few milliseconds, for ever."""

    def __init__(self) -> None:
        self.sent = 0

    async def receive(self) -> dict[str, Any]:
        await asyncio.sleep(0.01)
        self.sent += 1
        return {"type": "websocket.receive", "text": '{"type": "flush"}'}


def test_a_text_stream_that_sends_only_flush_still_ends_after_the_idle_time() -> None:
    """Any message used to start the idle clock again: a flush every 20 s held a socket (and its ingress slot) for
    ever. Only what makes audio starts it again now."""

    async def run(stream: TextStream) -> None:
        while True:
            assert isinstance(await stream.next_message(), StreamFlush)

    socket = _FlushingSocket()
    stream = TextStream(socket, max_frame_bytes=1000, idle_s=0.2)
    with pytest.raises(StreamIdleError, match=r"nothing to speak for 0\.2 s"):
        asyncio.run(asyncio.wait_for(run(stream), 30))
    assert socket.sent > 5  # it kept sending all along
    stream.close()


def test_text_streams_are_capped_below_the_slots_of_requests_by_default_and_by_choice() -> None:
    limits = AppArgs().limits
    assert (limits.max_text_streams, limits.max_text_streams_per_key) == (32, 4)  # of 64 slots, of 8 per key
    small = AppArgs(limits={"max_text_streams": 4, "max_concurrent_requests_per_key": 2}).limits
    assert (small.max_text_streams, small.max_text_streams_per_key) == (4, 1)
    assert AppArgs(limits={"max_concurrent_requests_per_key": None}).limits.max_text_streams_per_key is None
    # below the ingress's slots: checked where its deployment's options are known (test_config_knobs)


def test_text_streams_are_held_to_their_replicas_and_their_keys_caps() -> None:
    slots = TextStreamSlots(limit=3, per_key=2)
    assert slots.acquire("alice") is None and slots.acquire("alice") is None
    assert "(2, half its requests in flight)" in slots.acquire("alice")  # her third
    assert slots.acquire("bob") is None  # another key's
    assert "(3, limits.max_text_streams)" in slots.acquire(None)  # the replica's fourth, keys off or on
    slots.release("alice")
    assert slots.acquire("alice") is None and slots.held == 3
    for owner in ("alice", "alice", "bob"):
        slots.release(owner)
    assert slots.held == 0 and slots.acquire(None) is None


class _LeftSocket:
    """A text stream's socket whose client has gone: every send fails as Starlette's does then."""

    def __init__(self) -> None:
        self.scope = {"state": {"request_id": "req-left"}, "subprotocols": []}

    async def accept(self, subprotocol: str | None = None) -> None:
        pass

    async def send_json(self, data: Any) -> None:
        raise WebSocketDisconnect(1006)

    async def close(self, code: int = 1000) -> None:
        raise WebSocketDisconnect(1006)


def test_a_client_that_left_is_logged_at_info_without_a_traceback_even_when_a_send_failed_first(
    serve_log: pytest.LogCaptureFixture,
) -> None:
    async def speak_stream(stream: TextStream, request_id: str) -> dict[str, int]:
        await stream.ws.send_json({"type": "speech.audio.delta"})  # the speaker's send met the gone client first
        return {}

    routes = SimpleNamespace(limits=LimitsArgs(), speak_stream=speak_stream)
    asyncio.run(SpeechStreamRoutes.serve_text_stream(routes, _LeftSocket()))
    assert [record.getMessage() for record in serve_log.records] == ["the client left the text stream"]
    assert serve_log.records[0].levelno == logging.INFO and serve_log.records[0].exc_info is None


def test_the_text_relay_keeps_a_sessions_pieces_for_a_call_sent_again() -> None:
    """A decoder call reads the pieces in order, waiting for each; one sent again to another replica (the first was
    lost before its first audio) reads them again from the first; closing the session wakes a waiting reader."""
    from deployments.text_relay import SessionTexts

    async def scenario() -> tuple[list, list, bool]:
        texts = SessionTexts()
        await texts.put("s", [1, 2])
        waiting = asyncio.create_task(texts.get("s", 1))
        await asyncio.sleep(0)
        assert not waiting.done()  # piece 1 has not come yet
        await texts.put("s", [3])
        await texts.put("s", None)
        first_call = [await texts.get("s", 0), await waiting, await texts.get("s", 2)]
        sent_again = [await texts.get("s", index) for index in range(3)]
        reader = asyncio.create_task(texts.get("s", 3))
        await asyncio.sleep(0)
        await texts.close("s")
        with pytest.raises(TextSessionClosedError):
            await reader
        with pytest.raises(TextSessionClosedError):
            await texts.get("s", 0)  # a call that starts after the close
        return first_call, sent_again, reader.done()

    first_call, sent_again, woken = asyncio.run(scenario())
    assert first_call == sent_again == [[1, 2], [3], None] and woken


class FakeRelay:
    """`TextRelay`'s `get` as the decoder calls it (`relay.get.remote(session, index)`, awaited), over a fixed list:
    an exception in it is raised; past its end, `get` waits for ever (a client that sends nothing more)."""

    def __init__(self, items: list[list[int] | Exception | None]) -> None:
        async def get(_session: str, index: int) -> list[int] | None:
            if index >= len(items):
                await asyncio.Event().wait()
            item = items[index]
            if isinstance(item, Exception):
                raise item
            return item

        self.get = SimpleNamespace(remote=get)


def test_decoder_bistream_speaks_the_relayed_text_in_the_loop_within_the_ceilings() -> None:
    """The replica's bi-stream call on its loop: the relayed pieces spoken, the ceilings the loop keeps (the time one
    while the utterance waits for text), a closed session ending quietly, a refused piece ending it alone; each time
    the replica's count of utterances goes back to 0."""
    tts = CosyVoice.load("cosyvoice3-tiny")
    sampling = SamplingOptions(seed=3, max_token_text_ratio=3.0)
    start = tts.encoder.bistream_start(SynthesisRequest(text="", voice=tts.voices[0], sampling=sampling))
    pieces = [tts.encoder.text_piece_tokens(word) for word in ("Hello ", "there, ", "this is ", "a test.")]

    def replica(max_audio_s: float | None = None, max_request_s: float | None = None) -> LoopBridge:
        scheduler = Scheduler(tts.decoder, max_live=2, max_audio_s=max_audio_s, max_request_s=max_request_s)
        bridge = LoopBridge(scheduler, ReplicaLoadTracker(2), SimpleNamespace(), 2, 0.0, 1)
        # A loop thread of its own, started here: the bridge's would call back into the first test's event loop.
        bridge._loop_thread = threading.Thread(
            target=scheduler.run, args=(lambda busy: None, as_request_error), daemon=True
        )
        bridge._loop_thread.start()
        bridge.published = []  # the utterances in the loop each time the gauges were set
        bridge.publish_load = lambda: bridge.published.append(bridge.bistreams)
        return bridge

    async def run(bridge: LoopBridge, items: list[list[int] | Exception | None] | None = None) -> list:
        relay = FakeRelay([*pieces, None] if items is None else items)
        return [chunk async for chunk in bridge.bistream(start, relay, "s", "req-1")]

    spoken = replica()
    audio = np.concatenate(asyncio.run(run(spoken)))
    assert np.isfinite(audio).all() and len(audio) > tts.sample_rate // 10
    assert spoken.bistreams == 0 and spoken.published == [1, 0]  # counted in, then out
    # A client that sends a piece and then nothing: the wall-clock ceiling ends it while it waits for text.
    waiting = replica(max_request_s=0.2)
    with pytest.raises(DecodeLimitError, match=r"longer than the limit of 0\.2 s"):
        asyncio.run(asyncio.wait_for(run(waiting, pieces[:1]), 30))
    assert waiting.bistreams == 0
    # Its session closed by the ingress (the client left): it ends, quietly.
    closed = replica()
    assert asyncio.run(run(closed, [TextSessionClosedError()])) == [] and closed.bistreams == 0
    limited = replica(max_audio_s=0.1)
    with pytest.raises(DecodeLimitError, match=r"0\.1 s of audio"):
        asyncio.run(run(limited))
    refused = replica()
    with pytest.raises(InvalidInputError, match="text ids"):
        asyncio.run(run(refused, [[-1]]))
    assert refused.bistreams == 0
    ended = time.monotonic() + 30  # the loop thread forgets the ended utterance at its step after handing on the error
    while refused.scheduler.live and time.monotonic() < ended:
        time.sleep(0.01)
    assert refused.scheduler.live == 0
