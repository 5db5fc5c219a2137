"""Streaming synthesis for a batch of segments, chunked as each model family's official streaming loop does.

Speech tokens are generated for all segments together (one `TokenGenerator`); whenever a segment has enough new
tokens for a chunk, they go through the flow and the vocoder while generation goes on. The model family names its
`ChunkStrategy` (engine.families.chunking): when a stream has a chunk and how a chunk's mel and audio are made.
Tokens reach the flow as in the official `llm_job`: a family's silent tokens are dropped past a run of 5
(`engine.llm.generation.SilentRunFilter`; the whole-utterance path drops the same ones).
A family without a strategy refuses streaming with an `InvalidInputError`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from engine.errors import (
    CosyVoiceError,
    InvalidInputError,
    NonFiniteOutputError,
    as_request_error,
    isolate_failures,
)
from engine.families.chunking import Chunk, ChunkStrategy, StreamState
from engine.llm.generation import SilentRunFilter, TokenEvent, TokenGenerator
from engine.llm.sampling import make_generator
from engine.runtime.memory import is_out_of_memory
from engine.runtime.segment import EncodedSegment


class DecodeStream:
    """Iterate to advance every segment; each step yields one entry per segment, in order: a float32
    numpy chunk of new audio (often empty), a `NonFiniteOutputError` that ends that segment, or None once
    the segment has finished.
    """

    def __init__(self, decoder, segments: list, llm: TokenGenerator | None = None) -> None:
        # decoder: engine.runtime.decoder_stage.SpeechDecoderStage; llm: a generator shared with other work (the loop)
        model = decoder.model
        self.decoder = decoder
        self.llm = TokenGenerator(model.llm) if llm is None else llm
        # None: the family cannot stream yet; an empty stream is still made (a decoder loop holds one) and
        # refuses each segment it is given
        strategy = model.config.family.streaming
        self.strategy: ChunkStrategy | None = None if strategy is None else strategy(decoder)
        self.streams: list[StreamState] = []
        self._by_llm_id: dict[int, StreamState] = {}
        self._fed_ids = 0  # fed streams get ids -1, -2, ...: no generator row has one, so cancelling them is a no-op
        for segment in segments:
            self.add(segment)

    def check_streamable(self, segment: EncodedSegment) -> None:
        """Raise InvalidInputError unless this model can stream `segment` (its family streams, at its speed)."""
        family = self.decoder.model.config.family
        if self.strategy is None:
            raise InvalidInputError(
                f"{family.name} models cannot stream yet: their chunk schedule and chunked flow and vocoder are not "
                "built; send the request whole (not streamed)"
            )
        if segment.speed != 1.0 and not self.strategy.streams_speed:
            raise InvalidInputError(
                f"{family.name} streams at speed 1.0 only, as the official code (its vocoder re-runs over the mel so "
                f"far, which a per-chunk stretch would change); got speed {segment.speed:g}: send speed 1.0, or the "
                "request whole (not streamed)"
            )

    def add(self, segment: EncodedSegment) -> StreamState:
        """Start streaming one more segment: its tokens are generated from the next step of `self.llm` on."""
        self.check_streamable(segment)
        [request] = self.decoder.generation_requests([segment])
        # the generator last: nothing after it can fail and leave its generator row behind
        stream = self._state(segment, self.llm.add(request))
        self.streams.append(stream)
        self._by_llm_id[stream.llm_id] = stream
        return stream

    def add_fed(self, segment: EncodedSegment) -> StreamState:
        """Start streaming a segment whose tokens its owner gives (`feed`, or `record` with events of its `llm_id`),
        not `self.llm` (bi-streaming); only its voice fields are read."""
        self.check_streamable(segment)
        self._fed_ids -= 1
        stream = self._state(segment, self._fed_ids)
        self.streams.append(stream)
        self._by_llm_id[stream.llm_id] = stream  # `record` takes its tokens too, as events of its id
        return stream

    def feed(self, stream: StreamState, tokens: list[int], done: bool) -> None:
        """The next tokens of a stream from `add_fed`, through the silent-run filter; `done`: no more will come."""
        stream.new_tokens += [token for token in tokens if stream.silent.keep(token)]
        stream.tokens_done = stream.tokens_done or done

    def _state(self, segment: EncodedSegment, llm_id: int) -> StreamState:
        device = self.decoder.model.decoder_device
        return StreamState(
            segment=segment,
            hop=self.strategy.schedule.token_hop,
            noise=make_generator(segment.sampling.seed),
            source=torch.Generator(device=device).manual_seed(segment.sampling.seed),
            silent=SilentRunFilter(self.decoder.model.config.family.silent_tokens),
            llm_id=llm_id,
        )

    def release(self, stream: StreamState) -> None:
        """Forget a stream (stopping it first if it still runs): for owners that add streams without end."""
        self.stop(stream)
        self.streams = [s for s in self.streams if s is not stream]  # by identity: == would compare arrays
        self._by_llm_id.pop(stream.llm_id, None)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    def cancel(self, index: int) -> None:
        """Stop segment `index`: its generation slot is freed at once; it yields None from now on."""
        self.stop(self.streams[index])

    def stop(self, stream: StreamState) -> None:
        """Stop one stream: its generation slot is freed at once; it makes no more audio."""
        if not stream.finished:
            self.llm.cancel(stream.llm_id)
            stream.finished = True

    def __iter__(self) -> Iterator[list[np.ndarray | NonFiniteOutputError | None]]:
        while not self.finished:
            yield self.step()

    @torch.inference_mode()
    def step(self) -> list[np.ndarray | NonFiniteOutputError | None]:
        self.record(self.llm.step())
        audio = {}
        for stream, chunk in self.emit():
            if isinstance(chunk, torch.cuda.OutOfMemoryError):  # nothing here makes room: the stream ends
                self.stop(stream)
                chunk = as_request_error(chunk)
            audio[id(stream)] = chunk
        out: list[np.ndarray | NonFiniteOutputError | None] = []
        for stream in self.streams:
            if id(stream) in audio:
                out.append(audio[id(stream)])
            elif stream.finished:
                out.append(None)
            else:
                out.append(np.zeros(0, dtype=np.float32))
        return out

    def record(self, events: list[TokenEvent]) -> None:
        """Take the tokens of this object's streams from one step of `self.llm` (other requests' are skipped)."""
        for event in events:
            stream = self._by_llm_id.get(event.request_id)
            if stream is None:
                continue
            if event.error is not None:  # this stream's own generation failed (a loop filters these out first)
                raise event.error
            if event.token is not None and stream.silent.keep(event.token):
                stream.new_tokens.append(event.token)
            stream.tokens_done = stream.tokens_done or event.finish_reason is not None

    def may_emit(self, stream: StreamState, waiting: list[TokenEvent]) -> bool:
        """Whether an `emit` after recording `waiting` (the stream's events not yet recorded) could give the stream
        a chunk: False means a job now would only record tokens, which costs a lane round trip per LLM step."""
        if stream.finished:
            return False
        if stream.tokens_done or any(event.finish_reason is not None for event in waiting):
            return True
        assert self.strategy is not None  # a stream was added
        # an upper bound of the tokens kept: the silent-run filter may drop some of `waiting`
        tokens = len(stream.new_tokens) + sum(event.token is not None for event in waiting)
        return tokens >= self.strategy.tokens_wanted(stream)

    @torch.inference_mode()
    def emit(
        self, streams: list[StreamState] | None = None
    ) -> list[tuple[StreamState, np.ndarray | NonFiniteOutputError | CosyVoiceError | torch.cuda.OutOfMemoryError]]:
        """Every stream (of `streams`; default all) that has a chunk's worth of tokens gets its audio, all of them in
        one flow + vocoder batch. Emits over disjoint `streams` change only their own streams' state (and the
        generator, to stop a stream whose audio is not finite). A batch that raises is put back and run again stream
        by stream: a stream that fails alone is stopped with its error, the others' audio is as if it was not there;
        one that runs out of device memory alone is left put back, with the `torch.cuda.OutOfMemoryError` as its
        entry (its owner may make room and emit it again)."""
        live = [stream for stream in (self.streams if streams is None else streams) if not stream.finished]
        if not live:  # also when the family cannot stream: no stream was ever added
            return []
        saved = {id(stream): stream.checkpoint() for stream in live}

        def failed(stream: StreamState, error: CosyVoiceError) -> list[tuple[StreamState, Exception]]:
            if is_out_of_memory(error):
                return [(stream, error.__cause__)]
            self.stop(stream)
            return [(stream, error)]

        return isolate_failures(live, self._emit, failed, undo=lambda stream: stream.restore(saved[id(stream)]))

    def _emit(self, live: list[StreamState]) -> list[tuple[StreamState, np.ndarray | NonFiniteOutputError]]:
        chunks = [chunk for chunk in map(self.strategy.next_chunk, live) if chunk is not None]
        if not chunks:
            return []
        return list(zip((c.stream for c in chunks), self._synthesize(chunks), strict=True))

    def _synthesize(self, chunks: list[Chunk]) -> list[np.ndarray | NonFiniteOutputError]:
        """Audio of each chunk; a non-finite chunk ends its segment with an error, the others go on."""
        strategy = self.strategy
        mels = strategy.chunk_mels(chunks)
        stitched = [strategy.stitch_mel(chunk, mel) for chunk, mel in zip(chunks, mels, strict=True)]
        waves = strategy.vocode(chunks, stitched)
        out: list[np.ndarray | NonFiniteOutputError] = []
        for chunk, wave in zip(chunks, waves, strict=True):
            audio = wave.float().cpu().numpy()
            if np.isfinite(audio).all():
                out.append(audio)
            else:
                out.append(NonFiniteOutputError("the vocoder produced NaN or inf samples; no audio returned"))
                self.stop(chunk.stream)
        return out
