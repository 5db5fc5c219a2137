"""How each model family streams: when a stream has a chunk of speech tokens, and how the chunk becomes audio.

A family (engine.families) names its `ChunkStrategy`; `engine.runtime.streaming.DecodeStream` drives it while the
LLM generates. A strategy acts on a `StreamState` (one segment's tokens so far, flow and vocoder caches):
`OverlappingChunks` (v1: overlapping token chunks, the flow's start noise kept, mel frames cross-faded),
`CausalPrefixChunks` (v2: the causal flow over the whole token prefix with chunk masks, hops 25 -> 50 -> 100) and
`CausalPrefixRerunChunks` (v3: the v2 chunks, the causal vocoder run again over a bounded window of the mel so far).
Tokens reach the flow as in the official `llm_job` (silent runs cut past 5). Each strategy rule by rule, against the
official code: docs/models.md, "Streaming chunk by chunk".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from engine.flow.masked_diff import mel_frames, target_frames
from engine.llm.generation import SilentRunFilter
from engine.vocoder.causal_hift import VocoderStream


@dataclass(frozen=True)
class StreamSchedule:
    """Chunk sizes of a streaming strategy, in speech tokens / mel frames / waveform samples."""

    token_hop: int  # new tokens per chunk
    token_max_hop: int
    hop_growth: float  # the hop is multiplied by this after every chunk
    token_overlap: int  # tokens shared by consecutive chunks
    mel_overlap: int  # mel frames of those tokens, cross-faded
    mel_cache: int  # mel frames the vocoder sees again in front of the next chunk
    source_cache: int  # waveform samples of those frames, cross-faded
    lookahead: int = 0  # newest tokens held back as the flow's look-ahead context
    frames_per_token: int = 0  # mel frames per token (0: the flow interpolates instead)


def cross_fade(fade_in: Tensor, fade_out: Tensor, window: Tensor) -> Tensor:
    """Blend the first half-window of `fade_in` with the last half-window of `fade_out` (last dim)."""
    half = window.shape[0] // 2
    blended = fade_in.clone()
    blended[..., :half] = fade_in[..., :half] * window[:half] + fade_out[..., -half:] * window[half:]
    return blended


@dataclass
class StreamState:
    segment: object  # engine.runtime.segment.EncodedSegment
    llm_id: int
    hop: int
    noise: torch.Generator
    source: torch.Generator
    silent: SilentRunFilter  # drops the tokens the flow never gets
    new_tokens: list[int] = field(default_factory=list)  # overlapping: not yet sent to the flow; prefix: all so far
    token_offset: int = 0  # prefix: tokens whose audio has been sent
    tokens_done: bool = False
    finished: bool = False
    flow_cache: Tensor | None = None  # overlapping: [80, n, 2] start noise and mu of prompt + overlap frames
    mel_overlap: Tensor | None = None  # [80, mel_overlap]
    hift_mel: Tensor | None = None  # [80, mel_cache]
    hift_source: Tensor | None = None  # [1, source_cache]
    hift_speech: Tensor | None = None  # [source_cache]
    vocoder: VocoderStream | None = None  # re-run: the causal vocoder's window of the mel so far
    written: Any = None  # CUDA: the event after the last work on it (engine.runtime.handoff.hand_over)

    def checkpoint(self) -> dict[str, Any]:
        """What a chunk changes (its fields are replaced, never changed in place, but for the random generators'
        states): put back by `restore` when the chunk's batch fails half-way and is run again."""
        state = dict(vars(self))
        state["vocoder"] = copy.copy(self.vocoder)
        state["random_states"] = (self.noise.get_state(), self.source.get_state())
        return state

    def restore(self, state: dict[str, Any]) -> None:
        fields = dict(state)
        noise_state, source_state = fields.pop("random_states")
        vars(self).update(fields, vocoder=copy.copy(fields["vocoder"]))
        self.noise.set_state(noise_state)
        self.source.set_state(source_state)


@dataclass
class Chunk:
    stream: StreamState
    tokens: list[int]
    final: bool
    mel_start: int = 0  # prefix: frames of the flow output already sent by earlier chunks


class ChunkStrategy:
    """How one model family streams: when a stream has a chunk (`next_chunk`), how a batch of chunks becomes mel
    (`chunk_mels`); the mel cross-fade and the cached vocoding (`stitch_mel`, `vocode`) are shared."""

    streams_speed: ClassVar[bool] = True  # speed != 1 stretches each chunk's mel (CosyVoice3 refuses it, as officially)

    def __init__(self, decoder, schedule: StreamSchedule) -> None:
        # decoder: engine.runtime.decoder_stage.SpeechDecoderStage
        self.decoder = decoder
        self.schedule = schedule
        self.mel_window = torch.from_numpy(np.hamming(2 * schedule.mel_overlap)).float()
        self.speech_window = torch.from_numpy(np.hamming(2 * schedule.source_cache)).float()

    def next_chunk(self, stream: StreamState) -> Chunk | None:
        """The stream's next chunk once it has enough tokens (its state advances), else None."""
        raise NotImplementedError

    def tokens_wanted(self, stream: StreamState) -> int:
        """How many `new_tokens` the stream needs before `next_chunk` gives a chunk that is not its last."""
        raise NotImplementedError

    def chunk_mels(self, chunks: list[Chunk]) -> list[Tensor]:
        """The new mel frames [80, n] fp32 CPU of each chunk, all chunks through the flow together."""
        raise NotImplementedError

    def _advance_hop(self, stream: StreamState) -> None:
        stream.hop = min(self.schedule.token_max_hop, int(stream.hop * self.schedule.hop_growth))

    def stitch_mel(self, chunk: Chunk, mel: Tensor) -> Tensor:
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

    def vocode(self, chunks: list[Chunk], mels: list[Tensor]) -> list[Tensor]:
        """HiFT over the chunks with the cached source in front, then the waveform cross-fade. A chunk without mel
        frames (a stream whose LLM stopped before its first token, so nothing is cached either) gets no audio."""
        voiced = [row for row, mel in enumerate(mels) if mel.shape[1]]
        waves = [torch.zeros(0) for _ in chunks]
        if voiced:
            made = self._vocode_voiced([chunks[row] for row in voiced], [mels[row] for row in voiced])
            for row, wave in zip(voiced, made, strict=True):
                waves[row] = wave
        return waves

    def _vocode_voiced(self, chunks: list[Chunk], mels: list[Tensor]) -> list[Tensor]:
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


class OverlappingChunks(ChunkStrategy):
    """CosyVoice v1: chunks of `hop + overlap` new tokens, the flow continuing the previous chunk's noise and mu."""

    def __init__(self, decoder) -> None:
        token_rate, mel_cache, overlap = decoder.model.config.flow.input_frame_rate, 20, 20
        schedule = StreamSchedule(
            token_hop=2 * token_rate,
            token_max_hop=4 * token_rate,
            hop_growth=1.0,
            token_overlap=overlap,
            mel_overlap=mel_frames(overlap, token_rate),
            mel_cache=mel_cache,
            source_cache=mel_cache * decoder.model.config.hift.hop,
        )
        super().__init__(decoder, schedule)

    def tokens_wanted(self, stream: StreamState) -> int:
        return stream.hop + self.schedule.token_overlap

    def next_chunk(self, stream: StreamState) -> Chunk | None:
        size = self.tokens_wanted(stream)
        if len(stream.new_tokens) >= size:
            tokens = stream.new_tokens[:size]
            stream.new_tokens = stream.new_tokens[stream.hop :]
            self._advance_hop(stream)
            return Chunk(stream, tokens, final=False)
        if stream.tokens_done:
            stream.finished = True
            return Chunk(stream, stream.new_tokens, final=True)
        return None

    def chunk_mels(self, chunks: list[Chunk]) -> list[Tensor]:
        """The flow over each chunk's tokens, continuing the previous chunk's noise and mu on the overlap."""
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
                z = self.start_noise(stream, flow.config.output_size, conditioning.mel_lengths[row])
                if stream.flow_cache is not None:
                    cached = stream.flow_cache.shape[1]
                    z[:, :cached] = stream.flow_cache[:, :, 0]
                    conditioning.mu[row, :, :cached] = stream.flow_cache[:, :, 1].to(conditioning.mu.dtype)
                noise.append(z)
            caches = conditioning.flow_cache(noise)
            padded = pad_sequence([z.t() for z in noise], batch_first=True).transpose(1, 2).to(device)
            feat = flow.decoder(padded, conditioning.mu, conditioning.mask, conditioning.spks, conditioning.cond)
            targets = target_frames(feat, conditioning.prompt_frames, conditioning.mel_lengths)
            for row, i in enumerate(live):
                chunks[i].stream.flow_cache = caches[row]
                mels[i] = targets[row].float().cpu()
        return mels

    @staticmethod
    def start_noise(stream: StreamState, channels: int, frames: int) -> Tensor:
        """A chunk's CFM start noise [channels, frames] (the parity tests replay the official draws here)."""
        return torch.randn(channels, frames, generator=stream.noise)


class CausalPrefixChunks(ChunkStrategy):
    """CosyVoice2: the causal flow over the whole token prefix, hops aligned with its training chunks."""

    hift_cache_frames: ClassVar[int] = 8  # the official v2 HiFT cache: 160 ms

    def __init__(self, decoder) -> None:
        flow, mel_cache = decoder.model.config.flow, self.hift_cache_frames
        chunk_tokens = self.training_chunk_tokens(flow)
        schedule = StreamSchedule(
            token_hop=chunk_tokens,  # must equal the flow's training chunk size
            token_max_hop=4 * chunk_tokens,
            hop_growth=2.0,
            token_overlap=0,
            mel_overlap=0,
            mel_cache=mel_cache,
            source_cache=mel_cache * decoder.model.config.hift.hop,
            lookahead=flow.pre_lookahead_len,
            frames_per_token=flow.token_mel_ratio,
        )
        super().__init__(decoder, schedule)

    @staticmethod
    def training_chunk_tokens(flow) -> int:
        """Tokens per static chunk of the causal flow's training (flow: its config), the first hop."""
        return flow.encoder_chunk_size

    def _hop_end(self, stream: StreamState) -> int:
        """The end of the stream's next hop in its token prefix."""
        hop = stream.hop
        if stream.token_offset == 0:  # the first hop completes the prompt's last training chunk
            hop += -len(stream.segment.flow_prompt_speech_tokens) % self.schedule.token_hop
        return stream.token_offset + hop

    def tokens_wanted(self, stream: StreamState) -> int:
        return self._hop_end(stream) + self.schedule.lookahead

    def next_chunk(self, stream: StreamState) -> Chunk | None:
        """The whole token prefix up to the next hop plus the look-ahead, or everything once generation ends."""
        end = self._hop_end(stream)
        mel_start = stream.token_offset * self.schedule.frames_per_token
        if len(stream.new_tokens) >= end + self.schedule.lookahead:
            chunk = Chunk(stream, stream.new_tokens[: end + self.schedule.lookahead], final=False, mel_start=mel_start)
            stream.token_offset = end
            self._advance_hop(stream)
            return chunk
        if stream.tokens_done:
            stream.finished = True
            return Chunk(stream, list(stream.new_tokens), final=True, mel_start=mel_start)
        return None

    def chunk_mels(self, chunks: list[Chunk]) -> list[Tensor]:
        """The causal flow (chunk masks) over each chunk's token prefix; the new frames from `mel_start` on."""
        decoder, flow = self.decoder, self.decoder.model.flow
        mels: list[Tensor] = [torch.zeros(decoder.model.config.mel_bins, 0) for _ in chunks]
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


class CausalPrefixRerunChunks(CausalPrefixChunks):
    """CosyVoice3: the CosyVoice2 chunks and flow calls; the causal vocoder re-runs over the mel so far and each
    chunk is its output past the samples already sent (no HiFT cache, no cross-fade, no speed change)."""

    streams_speed = False  # official: "speed change only support non-stream inference mode"
    hift_cache_frames = 0

    @staticmethod
    def training_chunk_tokens(flow) -> int:
        """The DiT's static attention chunk (50 mel frames in the released model), in tokens."""
        return flow.estimator.static_chunk_size // flow.token_mel_ratio

    def stitch_mel(self, chunk: Chunk, mel: Tensor) -> Tensor:
        """Nothing to stitch: the vocoder keeps the mel so far itself."""
        return mel

    def vocode(self, chunks: list[Chunk], mels: list[Tensor]) -> list[Tensor]:
        """The vocoder over each stream's mel so far (one batch), the samples past those already sent."""
        hift = self.decoder.model.hift
        for chunk in chunks:
            if chunk.stream.vocoder is None:
                chunk.stream.vocoder = hift.start_stream()
        return hift.continue_streams([c.stream.vocoder for c in chunks], mels, [c.final for c in chunks])
