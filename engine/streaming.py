"""Streaming synthesis for a batch of segments, chunked as the official `CosyVoiceModel.tts` (v1) and
`CosyVoice2Model.tts` (v2) do.

Speech tokens are generated for all segments together (one `TokenGenerator`); whenever a segment has
enough new tokens for a chunk, they go through the flow and the vocoder while generation goes on.
- v1: a chunk is `hop + overlap` new tokens; the flow keeps the start noise and `mu` of the overlapping
  frames (its `flow_cache`), so the chunk continues the previous one's trajectory, and the overlapping mel
  frames are cross-faded (Hamming).
- v2: the causal flow runs on the whole token prefix with chunk masks; a chunk ends `pre_lookahead` tokens
  before the newest token (they are only look-ahead context), its mel starts at `2 * token_offset`, and the
  first hop is padded so that chunks line up with the 25-token training chunks counted from the prompt.
  Hops grow 25 -> 50 -> 100 tokens.
- Both: the vocoder gets the last mel frames and source samples of the previous chunk in front of the new
  ones (HiFT cache), and the cached tail of the previous waveform is cross-faded into the new one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from engine.errors import NonFiniteOutputError
from engine.flow import mel_frames
from engine.llm import TokenEvent, TokenGenerator
from engine.sampling import make_generator


@dataclass(frozen=True)
class StreamSchedule:
    """Chunk sizes of v1 streaming, in speech tokens / mel frames / waveform samples."""

    token_hop: int  # new tokens per chunk
    token_max_hop: int
    hop_growth: float  # the hop is multiplied by this after every chunk (1.0 in v1)
    token_overlap: int  # tokens shared by consecutive chunks
    mel_overlap: int  # mel frames of those tokens, cross-faded
    mel_cache: int  # mel frames the vocoder sees again in front of the next chunk
    source_cache: int  # waveform samples of those frames, cross-faded
    lookahead: int = 0  # v2: newest tokens held back as the flow's look-ahead context
    frames_per_token: int = 0  # v2: mel frames per token (v1 interpolates instead)

    @classmethod
    def v1(cls, token_rate: int, samples_per_frame: int) -> StreamSchedule:
        overlap = 20
        mel_cache = 20
        return cls(
            token_hop=2 * token_rate,
            token_max_hop=4 * token_rate,
            hop_growth=1.0,
            token_overlap=overlap,
            mel_overlap=mel_frames(overlap, token_rate),
            mel_cache=mel_cache,
            source_cache=mel_cache * samples_per_frame,
        )

    @classmethod
    def v2(cls, chunk_tokens: int, lookahead: int, frames_per_token: int, samples_per_frame: int) -> StreamSchedule:
        mel_cache = 8  # the official v2 HiFT cache: 160 ms
        return cls(
            token_hop=chunk_tokens,  # must equal the flow's training chunk size
            token_max_hop=4 * chunk_tokens,
            hop_growth=2.0,
            token_overlap=0,
            mel_overlap=0,
            mel_cache=mel_cache,
            source_cache=mel_cache * samples_per_frame,
            lookahead=lookahead,
            frames_per_token=frames_per_token,
        )


def cross_fade(fade_in: Tensor, fade_out: Tensor, window: Tensor) -> Tensor:
    """Blend the first half-window of `fade_in` with the last half-window of `fade_out` (last dim)."""
    half = window.shape[0] // 2
    blended = fade_in.clone()
    blended[..., :half] = fade_in[..., :half] * window[:half] + fade_out[..., -half:] * window[half:]
    return blended


@dataclass
class _Stream:
    segment: object  # engine.pipeline.EncodedSegment
    llm_id: int
    hop: int
    noise: torch.Generator
    source: torch.Generator
    new_tokens: list[int] = field(default_factory=list)  # v1: not yet sent to the flow; v2: all tokens so far
    token_offset: int = 0  # v2: tokens whose audio has been sent
    first_hop_pad: int = 0  # v2: extra tokens of the first hop that align the chunks with the prompt's
    tokens_done: bool = False
    finished: bool = False
    flow_cache: Tensor | None = None  # [80, n, 2] start noise and mu of prompt + overlap frames
    mel_overlap: Tensor | None = None  # [80, mel_overlap]
    hift_mel: Tensor | None = None  # [80, mel_cache]
    hift_source: Tensor | None = None  # [1, source_cache]
    hift_speech: Tensor | None = None  # [source_cache]


@dataclass
class _Chunk:
    stream: _Stream
    tokens: list[int]
    final: bool
    mel_start: int = 0  # v2: frames of the flow output already sent by earlier chunks


class DecodeStream:
    """Iterate to advance every segment; each step yields one entry per segment, in order: a float32
    numpy chunk of new audio (often empty), a `NonFiniteOutputError` that ends that segment, or None once
    the segment has finished.
    """

    def __init__(self, decoder, segments: list, llm: TokenGenerator | None = None) -> None:
        # decoder: engine.pipeline.SpeechDecoderStage; llm: a generator shared with other work (the scheduler's)
        model = decoder.model
        self.decoder = decoder
        self.llm = TokenGenerator(model.llm) if llm is None else llm
        hop, flow = model.config.hift.hop, model.config.flow
        self.version = model.config.version
        if self.version == 1:
            self.schedule = StreamSchedule.v1(flow.input_frame_rate, hop)
        else:
            chunk, lookahead, ratio = flow.encoder_chunk_size, flow.pre_lookahead_len, flow.token_mel_ratio
            self.schedule = StreamSchedule.v2(chunk, lookahead, ratio, hop)
        self.mel_window = torch.from_numpy(np.hamming(2 * self.schedule.mel_overlap)).float()
        self.speech_window = torch.from_numpy(np.hamming(2 * self.schedule.source_cache)).float()
        self.streams: list[_Stream] = []
        self._by_llm_id: dict[int, _Stream] = {}
        for segment in segments:
            self.add(segment)

    def add(self, segment) -> _Stream:
        """Start streaming one more segment: its tokens are generated from the next step of `self.llm` on."""
        [request] = self.decoder.generation_requests([segment])
        device = self.decoder.model.decoder_device
        stream = _Stream(
            segment=segment,
            llm_id=self.llm.add(request),
            hop=self.schedule.token_hop,
            noise=make_generator(segment.sampling.seed),
            source=torch.Generator(device=device).manual_seed(segment.sampling.seed),
            first_hop_pad=-len(segment.flow_prompt_speech_tokens) % self.schedule.token_hop,
        )
        self.streams.append(stream)
        self._by_llm_id[stream.llm_id] = stream
        return stream

    def release(self, stream: _Stream) -> None:
        """Forget a stream (stopping it first if it still runs): for owners that add streams without end."""
        self.stop(stream)
        self.streams = [s for s in self.streams if s is not stream]  # by identity: == would compare arrays
        del self._by_llm_id[stream.llm_id]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    def cancel(self, index: int) -> None:
        """Stop segment `index`: its generation slot is freed at once; it yields None from now on."""
        self.stop(self.streams[index])

    def stop(self, stream: _Stream) -> None:
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
        audio = {id(stream): chunk for stream, chunk in self.emit()}
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
            if event.token is not None:
                stream.new_tokens.append(event.token)
            stream.tokens_done = stream.tokens_done or event.finish_reason is not None

    @torch.inference_mode()
    def emit(self, streams: list[_Stream] | None = None) -> list[tuple[_Stream, np.ndarray | NonFiniteOutputError]]:
        """Every stream (of `streams`; default all) that has a chunk's worth of tokens gets its audio, all of them in
        one flow + vocoder batch. Emits over disjoint `streams` change only their own streams' state (and the
        generator, to stop a stream whose audio is not finite)."""
        chunks = [c for c in map(self._next_chunk, self.streams if streams is None else streams) if c is not None]
        if not chunks:
            return []
        return list(zip((c.stream for c in chunks), self._synthesize(chunks), strict=True))

    def _next_chunk(self, stream: _Stream) -> _Chunk | None:
        if stream.finished:
            return None
        if self.version == 2:
            return self._next_prefix_chunk(stream)
        size = stream.hop + self.schedule.token_overlap
        if len(stream.new_tokens) >= size:
            tokens = stream.new_tokens[:size]
            stream.new_tokens = stream.new_tokens[stream.hop :]
            stream.hop = min(self.schedule.token_max_hop, int(stream.hop * self.schedule.hop_growth))
            return _Chunk(stream, tokens, final=False)
        if stream.tokens_done:
            stream.finished = True
            return _Chunk(stream, stream.new_tokens, final=True)
        return None

    def _next_prefix_chunk(self, stream: _Stream) -> _Chunk | None:
        """v2: the whole token prefix up to the next hop plus the look-ahead, or everything once generation ends."""
        hop = stream.hop + (stream.first_hop_pad if stream.token_offset == 0 else 0)
        end = stream.token_offset + hop
        mel_start = stream.token_offset * self.schedule.frames_per_token
        if len(stream.new_tokens) >= end + self.schedule.lookahead:
            chunk = _Chunk(stream, stream.new_tokens[: end + self.schedule.lookahead], final=False, mel_start=mel_start)
            stream.token_offset = end
            stream.hop = min(self.schedule.token_max_hop, int(stream.hop * self.schedule.hop_growth))
            return chunk
        if stream.tokens_done:
            stream.finished = True
            return _Chunk(stream, list(stream.new_tokens), final=True, mel_start=mel_start)
        return None

    def _synthesize(self, chunks: list[_Chunk]) -> list[np.ndarray | NonFiniteOutputError]:
        """Audio of each chunk; a non-finite chunk ends its segment with an error, the others go on."""
        mels = self._chunk_mels(chunks)
        waves = self._vocode(chunks, mels)
        out: list[np.ndarray | NonFiniteOutputError] = []
        for chunk, wave in zip(chunks, waves, strict=True):
            audio = wave.float().cpu().numpy()
            if np.isfinite(audio).all():
                out.append(audio)
            else:
                out.append(NonFiniteOutputError("the vocoder produced NaN or inf samples; no audio returned"))
                self.stop(chunk.stream)
        return out

    def _chunk_mels(self, chunks: list[_Chunk]) -> list[Tensor]:
        mels = self._prefix_mels(chunks) if self.version == 2 else self._overlapping_mels(chunks)
        return [self._stitch_mel(chunk, mel) for chunk, mel in zip(chunks, mels, strict=True)]

    def _prefix_mels(self, chunks: list[_Chunk]) -> list[Tensor]:
        """v2: the causal flow (chunk masks) over each chunk's token prefix; the new frames from `mel_start` on."""
        decoder, flow = self.decoder, self.decoder.model.flow
        mels: list[Tensor] = [torch.zeros(self.decoder.model.config.mel_bins, 0) for _ in chunks]
        # Intermediate chunks hold back the look-ahead tokens and attend within static chunks; the final one
        # uses the look-ahead and full attention (official: finalize=True without stream=True).
        for final in (False, True):
            fresh = [len(c.tokens) * self.schedule.frames_per_token > c.mel_start for c in chunks]
            rows = [i for i, c in enumerate(chunks) if c.final == final and fresh[i]]
            if not rows:
                continue
            requests = [decoder.flow_request(chunks[i].stream.segment, torch.tensor(chunks[i].tokens)) for i in rows]
            for i, feat in zip(rows, flow.inference(requests, streaming=not final, finalize=final), strict=True):
                mels[i] = feat[:, chunks[i].mel_start :].float().cpu()
        return mels

    def _overlapping_mels(self, chunks: list[_Chunk]) -> list[Tensor]:
        """v1: flow over each chunk's tokens, continuing the previous chunk's noise and mu on the overlap."""
        decoder, flow = self.decoder, self.decoder.model.flow
        device = decoder.model.decoder_device
        mels: list[Tensor] = [torch.zeros(flow.config.output_size, 0) for _ in chunks]
        live = [i for i, c in enumerate(chunks) if c.tokens]  # a final chunk may bring no new tokens
        if live:
            requests = [decoder.flow_request(chunks[i].stream.segment, torch.tensor(chunks[i].tokens)) for i in live]
            conditioning = flow.prepare(requests)
            noise = []
            for row, i in enumerate(live):
                stream = chunks[i].stream
                z = self._start_noise(stream, flow.config.output_size, conditioning.mel_lengths[row])
                if stream.flow_cache is not None:
                    cached = stream.flow_cache.shape[1]
                    z[:, :cached] = stream.flow_cache[:, :, 0]
                    conditioning.mu[row, :, :cached] = stream.flow_cache[:, :, 1].to(conditioning.mu.dtype)
                noise.append(z)
            caches = conditioning.flow_cache(noise)
            padded = pad_sequence([z.t() for z in noise], batch_first=True).transpose(1, 2).to(device)
            feat = flow.decoder(padded, conditioning.mu, conditioning.mask, conditioning.spks, conditioning.cond)
            spans = zip(conditioning.prompt_frames, conditioning.mel_lengths, strict=True)
            for row, (i, (start, end)) in enumerate(zip(live, spans, strict=True)):
                chunks[i].stream.flow_cache = caches[row]
                mels[i] = feat[row, :, start:end].float().cpu()
        return mels

    @staticmethod
    def _start_noise(stream: _Stream, channels: int, frames: int) -> Tensor:
        """v1: a chunk's CFM start noise [channels, frames] (the parity tests replay the official draws here)."""
        return torch.randn(channels, frames, generator=stream.noise)

    def _stitch_mel(self, chunk: _Chunk, mel: Tensor) -> Tensor:
        """Cross-fade the overlap, keep the next overlap back, apply speed, put the vocoder cache in front."""
        stream, overlap = chunk.stream, self.schedule.mel_overlap
        if stream.mel_overlap is not None and mel.shape[1] >= overlap:
            mel = cross_fade(mel, stream.mel_overlap, self.mel_window)
        elif stream.mel_overlap is not None:  # a final chunk shorter than the overlap: the held-back frames
            mel = stream.mel_overlap
        if not chunk.final and overlap:
            stream.mel_overlap = mel[:, -overlap:]
            mel = mel[:, :-overlap]
        mel = self.decoder.apply_speed(mel, stream.segment.speed)
        if stream.hift_mel is not None:
            mel = torch.cat([stream.hift_mel, mel], dim=1)
        return mel

    def _vocode(self, chunks: list[_Chunk], mels: list[Tensor]) -> list[Tensor]:
        """HiFT over the chunks with the cached source in front, then the waveform cross-fade."""
        hift = self.decoder.model.hift
        device = self.decoder.model.decoder_device
        lengths = torch.tensor([m.shape[1] for m in mels])
        batch = (
            pad_sequence([m.t() for m in mels], batch_first=True).transpose(1, 2).to(device, hift.conv_pre.bias.dtype)
        )
        f0 = hift.predict_f0(batch, lengths)
        sources = []
        for row, chunk in enumerate(chunks):
            frames = int(lengths[row])
            source = hift.make_source(f0[row : row + 1, :frames], chunk.stream.source)
            cached = chunk.stream.hift_source
            if cached is not None:
                source[:, :, : cached.shape[-1]] = cached.to(source.device)
            sources.append(F.pad(source, (0, (batch.shape[-1] - frames) * hift.config.hop)))
        speech = hift.decode(batch, torch.cat(sources), lengths)
        waves = []
        for row, chunk in enumerate(chunks):
            stream, cache = chunk.stream, self.schedule.source_cache
            wave = speech[row, : int(lengths[row]) * hift.config.hop].float().cpu()
            if stream.hift_speech is not None:
                wave = cross_fade(wave, stream.hift_speech, self.speech_window)
            if not chunk.final:
                stream.hift_mel = mels[row][:, -self.schedule.mel_cache :]
                stream.hift_source = sources[row][:, :, : wave.shape[0]][:, :, -cache:].cpu()
                stream.hift_speech = wave[-cache:]
                wave = wave[:-cache]
            waves.append(wave)
        return waves
