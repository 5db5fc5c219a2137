"""Stream state that crosses CUDA streams (engine.runtime.handoff, docs/scheduler.md "CUDA streams"), on CPU:
`take_over` waits for the writer's event and records every CUDA tensor of a state, whatever field holds it (mock
CUDA tensors and a mock stream); in the decoder loop, every chunk a lane makes is of a state that lane took over in
the same job, and the loop thread never works on a state (v1, v2 and v3 tiny models, a stream whose first chunk is
made on the first-audio lane and its next ones on the main lane)."""

from __future__ import annotations

import threading
import typing
from dataclasses import fields
from unittest import mock

import pytest
import torch
from torch import Tensor

from engine.families.chunking import StreamState
from engine.llm.sampling import SamplingOptions
from engine.runtime import handoff
from engine.runtime import lanes as lanes_module
from engine.runtime.handoff import SharedGenerator
from engine.runtime.lanes import FIRST, MAIN
from engine.runtime.pipeline import CosyVoice
from engine.runtime.scheduler import Scheduler
from engine.runtime.synthesis_request import SynthesisRequest
from engine.vocoder.causal_hift import VocoderStream
from tests.engine.conftest import Collected, step_until


def _tensor_fields(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [f.name for f in fields(cls) if "Tensor" in str(hints[f.name])]


def _cuda_mock() -> mock.MagicMock:
    tensor = mock.MagicMock(spec=Tensor)
    tensor.is_cuda = True
    return tensor


def test_take_over_waits_for_the_writer_and_records_every_cuda_tensor_of_a_state() -> None:
    state = StreamState(segment=None, llm_id=0, hop=1, noise=torch.Generator(), source=torch.Generator(), silent=None)
    cuda = {name: _cuda_mock() for name in _tensor_fields(StreamState)}
    assert {"flow_cache", "hift_mel", "hift_source", "hift_speech", "mel_overlap"} <= set(cuda)
    for name, tensor in cuda.items():
        setattr(state, name, tensor)
    vocoder_fields = _tensor_fields(VocoderStream)
    assert {"mel", "f0"} <= set(vocoder_fields)
    state.vocoder = VocoderStream(**{name: _cuda_mock() for name in vocoder_fields})
    state.new_tokens = [1, 2]
    state.written = object()
    stream = mock.MagicMock()

    handoff.take_over(state, stream=stream)

    stream.wait_event.assert_called_once_with(state.written)
    for tensor in [*cuda.values(), *(getattr(state.vocoder, name) for name in vocoder_fields)]:
        tensor.record_stream.assert_called_once_with(stream)


def test_on_cpu_take_over_and_hand_over_do_nothing() -> None:
    state = StreamState(segment=None, llm_id=0, hop=1, noise=torch.Generator(), source=torch.Generator(), silent=None)
    state.flow_cache = torch.zeros(2, 3, 2)
    handoff.take_over(state)
    handoff.hand_over([state], torch.device("cpu"))
    assert state.written is None


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "cosyvoice2-tiny", "cosyvoice3-tiny"])
def test_every_state_a_lane_works_on_was_taken_over_by_that_lane_in_that_job(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tts = CosyVoice.load(model)
    sampling = SamplingOptions(seed=4, min_token_text_ratio=30, max_token_text_ratio=30)
    [segment] = tts.encoder.encode(
        SynthesisRequest("A stream with several chunks of audio.", tts.voices[0], sampling=sampling)
    )
    loop = Scheduler(tts.decoder, max_live=4)
    log: list[tuple[str, str, int]] = []  # (what, thread, state)
    lock = threading.Lock()

    def note(what: str, state: StreamState) -> None:
        with lock:
            log.append((what, threading.current_thread().name, id(state)))

    take_over, hand_over, next_chunk = handoff.take_over, handoff.hand_over, loop.streams.strategy.next_chunk

    def taken(state: StreamState, stream: object = None) -> None:
        note("take", state)
        take_over(state, stream)

    def handed(states: list[StreamState], device: torch.device | None = None) -> None:
        for state in states:
            note("hand", state)
        hand_over(states, device)

    def used(state: StreamState):
        note("use", state)
        return next_chunk(state)

    monkeypatch.setattr(lanes_module, "take_over", taken)
    monkeypatch.setattr(lanes_module, "hand_over", handed)
    monkeypatch.setattr(loop.streams.strategy, "next_chunk", used)
    sink = Collected()
    loop.submit([segment], streaming=True, sink=sink)
    step_until(loop, lambda: sink.ended)

    assert sink.chunks and loop.stats.first_lane_chunks >= 1
    lanes_of_state: dict[int, set[str]] = {}
    held: dict[str, set[int]] = {}  # per thread: the states taken over in its running job
    for what, thread, state in log:
        assert thread.startswith("vocoder-"), f"{what} on {thread}: only the lanes work on stream state"
        if what == "take":
            held.setdefault(thread, set()).add(state)
        elif what == "use":
            assert state in held.get(thread, set()), f"{thread} worked on a state it had not taken over"
            lanes_of_state.setdefault(state, set()).add(thread.split("_")[0])
        else:
            held[thread].discard(state)
    # the case the helper is for: one state, chunks on both lanes
    assert any(lanes == {f"vocoder-{FIRST}", f"vocoder-{MAIN}"} for lanes in lanes_of_state.values()), lanes_of_state


def test_every_generator_call_runs_on_the_loop_stream_whichever_thread_makes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop_stream = object()
    entered: list[tuple[str, object]] = []

    class Recorded:
        def __init__(self, stream: object) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            entered.append((threading.current_thread().name, self.stream))

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(handoff, "loop_stream", lambda device: loop_stream)
    monkeypatch.setattr(handoff, "on_stream", Recorded)
    generator = mock.MagicMock()
    shared = SharedGenerator(generator, torch.device("cpu"))
    shared.add("request")
    shared.step()
    shared.pause([1], True)
    shared.resume([1])
    lane = threading.Thread(target=shared.cancel, args=(1,), name="vocoder-main_0")  # a lane stops a stream
    lane.start()
    lane.join()
    assert [stream for _, stream in entered] == [loop_stream] * 5
    assert entered[-1][0] == "vocoder-main_0"
    generator.cancel.assert_called_once_with(1)
