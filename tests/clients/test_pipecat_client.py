"""pipecat's `OpenAITTSService`, with its defaults but the base URL, against a running server.

pipecat-ai 1.14 requires protobuf < 7 (and soundfile 0.13), and Ray 2.60 beside it here cannot be imported with
protobuf 6, so pipecat and the server live in two environments: start `cosyvoice-serve run` from the server's, then
run this module from pipecat's with COSYVOICE_URL naming the server (docs/clients.md, "pipecat"). Skipped otherwise.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

SERVER_URL = os.environ.get("COSYVOICE_URL")
OPENAI_SAMPLE_RATE = 24000  # what OpenAI's `pcm` is, and what pipecat's OpenAI service expects

pytestmark = pytest.mark.skipif(SERVER_URL is None, reason="COSYVOICE_URL names no running server (docs/clients.md)")


def test_pipecats_openai_tts_service_speaks_with_its_defaults() -> None:
    frames = pytest.importorskip("pipecat.frames.frames")
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.openai.tts import OpenAITTSService
    from pipecat.workers.runner import WorkerRunner

    class Recorder(FrameProcessor):
        """Passes every frame on, keeping the audio that flows down to it and the errors that flow up to it."""

        def __init__(self) -> None:
            super().__init__()
            self.audio = bytearray()
            self.rates: set[int] = set()
            self.errors: list[str] = []

        async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, frames.TTSAudioRawFrame):
                self.audio += frame.audio
                self.rates.add(frame.sample_rate)
            elif isinstance(frame, frames.ErrorFrame):
                self.errors.append(frame.error)
            await self.push_frame(frame, direction)

    async def speak() -> tuple[Recorder, Recorder]:
        tts = OpenAITTSService(
            api_key="not-needed", base_url=f"{SERVER_URL}/v1", settings=OpenAITTSService.Settings(voice="alloy")
        )
        # Errors go upstream (pipecat's "TTS context ... completed with no audio" when the first audio takes over its
        # stop_frame_timeout_s, 3 s), the audio downstream.
        upstream, downstream = Recorder(), Recorder()
        pipeline = Pipeline([upstream, tts, downstream])
        worker = PipelineWorker(pipeline, params=PipelineParams(audio_out_sample_rate=OPENAI_SAMPLE_RATE))
        await worker.queue_frames([frames.TTSSpeakFrame("Hello from pipecat."), frames.EndFrame()])
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        await runner.run()
        return upstream, downstream

    upstream, downstream = asyncio.run(speak())
    assert not upstream.errors
    assert len(downstream.audio) > 0 and len(downstream.audio) % 2 == 0  # 16-bit mono
    assert downstream.rates == {OPENAI_SAMPLE_RATE}
