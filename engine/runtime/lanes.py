"""The decoder loop's two vocoding threads, the lanes: each runs one flow + vocoder job at a time beside the LLM steps.

The first-audio lane makes the first chunks of streams that have no audio yet; the main lane takes the other ready
work, in the policy's order (docs/scheduler.md, "Order: playback deadlines" and "Policy (fcfs lanes)"). The two
never work on the same stream; a stream's state moves between them through `engine.runtime.handoff`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from engine.errors import CosyVoiceError, isolate_failures
from engine.llm.generation import TokenEvent
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.handoff import hand_over, take_over
from engine.runtime.loop_state import SchedulerStats, Sentence, awaits_first_audio
from engine.runtime.memory import is_out_of_memory
from engine.runtime.playback import SchedulingPolicy
from engine.runtime.segment import EncodedSegment
from engine.runtime.streaming import DecodeStream

FIRST, MAIN = "first", "main"
JobKind = Literal["streams", "whole"]


@dataclass
class Job:
    """The flow + vocoder work running on a lane."""

    kind: JobKind
    future: Future[Any]
    sentences: list[Sentence]  # the sentences it works on
    to_release: list[Any] = field(default_factory=list)  # streams of cancelled sentences, released once it is over


class Lanes:
    """The two lanes and the job running on each. `start_jobs` and `take_finished` are called on the loop thread; a
    finished job sets `wakeup`. On CPU the loop thread and the lanes split the torch threads (at least one each); on
    CUDA each lane works on its own CUDA stream, so its kernels overlap the LLM's and the other lane's."""

    def __init__(
        self,
        stage: SpeechDecoderStage,
        streams: DecodeStream,
        policy: SchedulingPolicy,
        stats: SchedulerStats,
        wakeup: threading.Event,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stage, self.streams, self.policy, self.stats, self.clock = stage, streams, policy, stats, clock
        self._wakeup = wakeup
        self.jobs: dict[str, Job] = {}  # by lane, while running
        self._main_turn: JobKind = "streams"
        threads = torch.get_num_threads()
        self.loop_threads = max(1, threads - threads // 2)
        self._executors = {
            lane: ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"vocoder-{lane}", initializer=self._init_lane, initargs=(threads,)
            )
            for lane in (FIRST, MAIN)
        }

    def _init_lane(self, threads: int) -> None:
        torch.set_num_threads(max(1, threads // 2))  # per thread: the loop thread keeps its own count
        device = self.stage.model.decoder_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the weights' copies are done before another stream reads them
            torch.cuda.set_stream(torch.cuda.Stream(device))  # current for this thread only

    @property
    def running(self) -> bool:
        """A job is still at work (not merely finished and waiting to be taken in)."""
        return any(not job.future.done() for job in self.jobs.values())

    @property
    def all_running(self) -> bool:
        """There are jobs and none has finished: nothing for the loop thread to take in."""
        return bool(self.jobs) and not any(job.future.done() for job in self.jobs.values())

    def wait_all(self) -> None:
        wait([job.future for job in self.jobs.values()])

    def drop(self) -> None:
        """Forget the running jobs (the loop failed): their results are never taken in."""
        self.jobs = {}

    def release(self, sentence: Sentence) -> None:
        """Forget its stream now, or when the job that works on it is over."""
        job = next((job for job in self.jobs.values() if sentence in job.sentences), None)
        if job is None:
            self.streams.release(sentence.stream)
        else:
            job.to_release.append(sentence.stream)

    def take_finished(self) -> list[tuple[str, Job]]:
        """The finished jobs, off their lanes: (lane, job); the streams released meanwhile are forgotten once the
        caller has taken the results in (`forget_released`)."""
        finished = [(lane, job) for lane, job in self.jobs.items() if job.future.done()]
        for lane, job in finished:
            del self.jobs[lane]
            for sentence in job.sentences:
                sentence.in_job = False
        return finished

    def forget_released(self, job: Job) -> None:
        for stream in job.to_release:
            self.streams.release(stream)

    # --- choosing the jobs ----------------------------------------------------------------------------------

    def start_jobs(self, live: list[Sentence], batch: int) -> None:
        """Hand each free lane its next job of at most `batch` sentences of `live`.

        The first-audio lane takes the streams of requests that have no audio yet, in the policy's order for them
        (`first_audio_key`); the main lane takes such streams too if one of them is due first, else the ready work
        earliest deadline first, leaving for later what the policy holds while a stream waits for its first audio
        (fcfs: streams whose audio has started, those waiting longest first, and whole sentences, in turns)."""
        ready = [s for s in live if s.stream is not None and not s.in_job and self.streams.may_emit(s.stream, s.events)]
        now = self.clock()
        first = sorted(
            (s for s in ready if not s.request.audio_started), key=lambda s: self.policy.first_audio_key(s.request, now)
        )
        if FIRST not in self.jobs and first:
            self._start_streams_job(FIRST, first[:batch])
            first = first[batch:]
        if MAIN in self.jobs:
            return
        running = sorted((s for s in ready if s.request.audio_started), key=lambda s: s.recorded_at)
        whole = [s for s in live if s.stream is None and s.tokens_done and not s.done and not s.in_job]
        if self.policy.by_deadline:
            work = self._not_held(live, sorted(first + running + whole, key=lambda s: self.policy.deadline(s.request)))
            if work and work[0] in first:  # a first audio is due first: the first audios in their own order
                self._start_streams_job(MAIN, first[:batch])
            else:
                self._start_earliest(work, batch)
        elif first:
            self._start_streams_job(MAIN, first[:batch])
        elif running and (not whole or self._main_turn == "streams"):
            self._start_streams_job(MAIN, running[:batch])
            self._main_turn = "whole"
        elif whole:
            self._start_whole_job(whole[:batch])
            self._main_turn = "streams"

    def _not_held(self, live: list[Sentence], work: list[Sentence]) -> list[Sentence]:
        """`work` but what the policy holds back while a live stream waits for its first audio (`may_hold`)."""
        if not awaits_first_audio(live):
            return work
        now = self.clock()
        return [s for s in work if not self.policy.may_hold(s.request, now)]

    def _start_earliest(self, work: list[Sentence], batch: int) -> None:
        """The main lane's job: the earliest-deadline sentence's kind (streams or whole), the earliest of that kind."""
        if not work:
            return
        streams = work[0].stream is not None
        chosen = [s for s in work if (s.stream is not None) == streams][:batch]
        if streams:
            self._start_streams_job(MAIN, chosen)
        else:
            self._start_whole_job(chosen)

    def _start_whole_job(self, whole: list[Sentence]) -> None:
        tokens = [torch.tensor(s.tokens, dtype=torch.long) for s in whole]
        self._start(MAIN, "whole", whole, self.vocode, [s.segment for s in whole], tokens)

    def _start_streams_job(self, lane: str, sentences: list[Sentence]) -> None:
        """Take in the sentences' waiting tokens and emit the chunks they complete."""
        events = [event for s in sentences for event in s.events]
        for sentence in sentences:
            sentence.events, sentence.recorded_at = [], self.stats.llm_steps
        self._start(lane, "streams", sentences, self.emit, self.streams, events, [s.stream for s in sentences])

    def _start(self, lane: str, kind: JobKind, sentences: list[Sentence], work: Callable[..., Any], *args: Any) -> None:
        for sentence in sentences:
            sentence.in_job = True
        future = self._executors[lane].submit(work, *args)
        self.jobs[lane] = Job(kind, future, sentences)
        future.add_done_callback(lambda _: self._wakeup.set())

    # --- the work ------------------------------------------------------------------------------------------

    @staticmethod
    @torch.inference_mode()
    def emit(streams: DecodeStream, events: list[TokenEvent], chosen: list[Any]) -> list[Any]:
        """A lane: record the streams' waiting tokens, emit the chunks they complete -> [(stream, audio or error)].
        The states may have been written on the other lane's CUDA stream: taken over first, handed over after
        (engine.runtime.handoff)."""
        for state in chosen:
            take_over(state)
        try:
            streams.record(events)
            return streams.emit(chosen)
        finally:
            hand_over(chosen, streams.decoder.model.decoder_device)

    @torch.inference_mode()
    def vocode(self, segments: list[EncodedSegment], tokens: list[torch.Tensor]) -> list[np.ndarray | Exception]:
        """A lane: flow + vocoder of whole sentences (as `SpeechDecoderStage.decode_batch`); a sentence whose work
        fails alone gets its error (out of device memory: the `torch.cuda.OutOfMemoryError`, to be retried)."""

        def vocode(rows: list[int]) -> list[np.ndarray | CosyVoiceError]:
            chosen = [segments[row] for row in rows]
            return self.stage.vocode(chosen, self.stage.tokens_to_mel(chosen, [tokens[row] for row in rows]))

        def failed(_: int, error: CosyVoiceError) -> list[Exception]:
            return [error.__cause__ if is_out_of_memory(error) else error]

        return isolate_failures(list(range(len(segments))), vocode, failed)

    def emit_one(self, stream: Any) -> np.ndarray | CosyVoiceError:
        """The chunk of one stream (whose run ran out of memory and was put back), made on the calling thread;
        raises `torch.cuda.OutOfMemoryError` if it runs out again."""
        produced = self.emit(self.streams, [], [stream])
        audio = produced[0][1] if produced else np.zeros(0, dtype=np.float32)
        if isinstance(audio, torch.cuda.OutOfMemoryError):
            raise audio
        return audio

    def vocode_one(self, sentence: Sentence) -> np.ndarray | CosyVoiceError:
        """`emit_one` for a whole sentence."""
        [wave] = self.vocode([sentence.segment], [torch.tensor(sentence.tokens, dtype=torch.long)])
        if isinstance(wave, torch.cuda.OutOfMemoryError):
            raise wave
        return wave
