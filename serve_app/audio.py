"""Encoding float32 waveforms into the response formats, as whole files or as streams of chunks.

* wav and pcm stream as 16-bit mono samples (a wav stream starts with a header of unknown length); pcm is raw
  16-bit little-endian mono, as in OpenAI's API.
* mp3, opus (in Ogg) and aac (in ADTS) go through FFmpeg's encoders (PyAV), which emit audio frame by frame, so
  they stream too: each chunk of samples comes back as the bytes the encoder has completed so far.
* flac is written whole by libsndfile and cannot stream: its header holds the length and a checksum of the whole
  signal.
* A whole wav has its true sizes; a streamed one the open-ended header (sizes 0xFFFFFFFF: read to the end).
* mp3, aac and opus are encoded at fixed bit rates (`LOSSY_BIT_RATES`); `StreamResampler` brings
  the model's rate to the rate a client asked for (OpenAI's 24 kHz), chunk by chunk.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

import numpy as np
import soundfile as sf

from engine.errors import InvalidInputError

try:
    import av
except ImportError:  # mp3, opus and aac are then not offered
    av = None

OPENAI_SAMPLE_RATE = 24000  # OpenAI's speech endpoint answers at this rate in every format (its pcm: raw 24 kHz)
# libopus encodes at these rates only; other rates are resampled to the next one up.
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)
# Ogg holds pages back until they span this long (FFmpeg's default is 1 s, which would delay a stream by that).
OGG_PAGE_DURATION_US = 20_000
PCM_MAX = 32767
# Bits per second of the lossy formats, chosen for clean speech at 22-24 kHz mono: mp3 at the 160 kbit/s maximum of
# MPEG-2 layer III at those rates, aac and opus where speech has no audible artefacts.
LOSSY_BIT_RATES = {"mp3": 160_000, "aac": 96_000, "opus": 64_000}


@dataclass(frozen=True)
class AudioFormat:
    name: str
    media_type: str
    streamable: bool
    soundfile_format: tuple[str, str] | None = None  # (major format, subtype) of a libsndfile-written format
    codec: tuple[str, str] | None = None  # (FFmpeg encoder, muxer) of an encoded format


_KNOWN_FORMATS = (
    AudioFormat("wav", "audio/wav", streamable=True, soundfile_format=("WAV", "PCM_16")),
    AudioFormat("pcm", "audio/pcm", streamable=True),
    AudioFormat("flac", "audio/flac", streamable=False, soundfile_format=("FLAC", "PCM_16")),
    AudioFormat("mp3", "audio/mpeg", streamable=True, codec=("libmp3lame", "mp3")),
    AudioFormat("opus", "audio/ogg", streamable=True, codec=("libopus", "ogg")),
    AudioFormat("aac", "audio/aac", streamable=True, codec=("aac", "adts")),
)


def _writable(fmt: AudioFormat) -> bool:
    if fmt.codec is not None:
        return av is not None and fmt.codec[0] in av.codecs_available
    if fmt.soundfile_format is not None:
        major, subtype = fmt.soundfile_format
        return major in sf.available_formats() and subtype in sf.available_subtypes(major)
    return True


FORMATS: dict[str, AudioFormat] = {fmt.name: fmt for fmt in _KNOWN_FORMATS if _writable(fmt)}
STREAM_FORMATS = tuple(name for name, fmt in FORMATS.items() if fmt.streamable)


def audio_format(name: str, *, streaming: bool = False) -> AudioFormat:
    """The format called `name`; InvalidInputError lists what this server can write (or stream)."""
    choices = STREAM_FORMATS if streaming else tuple(FORMATS)
    if name not in choices:
        what = "streamed" if streaming and name in FORMATS else "written"
        raise InvalidInputError(f"audio format {name!r} cannot be {what} here; use one of: {', '.join(choices)}")
    return FORMATS[name]


def to_pcm16(audio: np.ndarray) -> bytes:
    """float32 [-1, 1] -> 16-bit little-endian PCM bytes (clipped)."""
    scaled = np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * PCM_MAX
    return np.round(scaled).astype("<i2").tobytes()


def streaming_wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header with unknown length (0xFFFFFFFF sizes), the usual choice for live streams."""
    unknown = 0xFFFFFFFF
    block_align = 2
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * block_align, block_align, 16)
        + b"data"
        + struct.pack("<I", unknown)
    )


class StreamEncoder(Protocol):
    def encode(self, audio: np.ndarray) -> bytes:
        """The bytes of the stream that `audio` (float32 [N], the next samples) completes; may be empty."""

    def finish(self) -> bytes:
        """The rest of the stream (buffered frames, trailers); call once, after the last `encode`."""


class PcmStreamEncoder:
    """16-bit samples, after `header` (the streaming WAV header, or nothing for pcm)."""

    def __init__(self, header: bytes) -> None:
        self.pending_header = header

    def encode(self, audio: np.ndarray) -> bytes:
        data, self.pending_header = self.pending_header + to_pcm16(audio), b""
        return data

    def finish(self) -> bytes:
        return self.encode(np.zeros(0, dtype=np.float32))


class _ByteSink:
    """A write-only file for the muxer: without `seek` it writes as it goes, and we take the bytes out."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data = b"".join(self.parts)
        self.parts.clear()
        return data


class CodecStreamEncoder:
    """An FFmpeg encoder and muxer (PyAV) fed chunk by chunk, in the encoder's fixed frame size; `bit_rate` in bits
    per second (None: the format's in `LOSSY_BIT_RATES`)."""

    def __init__(self, fmt: AudioFormat, sample_rate: int, bit_rate: int | None = None) -> None:
        if fmt.codec is None or av is None:
            raise InvalidInputError(f"audio format {fmt.name!r} is not an encoded format")
        encoder, muxer = fmt.codec
        self.input_rate = sample_rate
        rate = sample_rate
        if encoder == "libopus":
            rate = next((r for r in OPUS_SAMPLE_RATES if r >= sample_rate), OPUS_SAMPLE_RATES[-1])
        self.sink = _ByteSink()
        options = {"page_duration": str(OGG_PAGE_DURATION_US)} if muxer == "ogg" else {}
        self.container = av.open(self.sink, mode="w", format=muxer, options=options)
        self.stream = self.container.add_stream(encoder, rate=rate, layout="mono")
        context = self.stream.codec_context
        context.bit_rate = LOSSY_BIT_RATES[fmt.name] if bit_rate is None else bit_rate
        context.open()
        self.frame_size = context.frame_size
        self.time_base = Fraction(1, rate)
        self.resampler = av.AudioResampler(format=context.format.name, layout="mono", rate=rate)
        self.fifo = av.AudioFifo()
        self.samples_encoded = 0

    def encode(self, audio: np.ndarray) -> bytes:
        samples = np.ascontiguousarray(np.clip(audio, -1.0, 1.0), dtype=np.float32)
        if samples.size:
            frame = av.AudioFrame.from_ndarray(samples[None], format="flt", layout="mono")
            frame.sample_rate = self.input_rate
            self._queue(self.resampler.resample(frame))
        while self.fifo.samples >= self.frame_size:
            self._encode_frame(self.fifo.read(self.frame_size))
        return self.sink.take()

    def finish(self) -> bytes:
        self._queue(self.resampler.resample(None))
        data = self.encode(np.zeros(0, dtype=np.float32))
        if self.fifo.samples:
            self._encode_frame(self.fifo.read())  # a short last frame
        self.container.mux(self.stream.encode(None))
        self.container.close()
        return data + self.sink.take()

    def _queue(self, frames: list[av.AudioFrame]) -> None:
        for frame in frames:
            frame.pts = None  # the fifo only checks continuity of set timestamps
            self.fifo.write(frame)

    def _encode_frame(self, frame: av.AudioFrame) -> None:
        frame.pts, frame.time_base = self.samples_encoded, self.time_base
        self.samples_encoded += frame.samples
        self.container.mux(self.stream.encode(frame))


class StreamResampler:
    """Float32 mono audio from one rate to another, chunk by chunk (FFmpeg's resampler keeps the filter state
    between chunks, so the chunks join as the whole signal would)."""

    def __init__(self, from_rate: int, to_rate: int) -> None:
        self.from_rate = from_rate
        self.resampler = av.AudioResampler(format="flt", layout="mono", rate=to_rate)

    def resample(self, audio: np.ndarray) -> np.ndarray:
        samples = np.ascontiguousarray(audio, dtype=np.float32)
        if not samples.size:
            return samples
        frame = av.AudioFrame.from_ndarray(samples[None], format="flt", layout="mono")
        frame.sample_rate = self.from_rate
        return self._samples(self.resampler.resample(frame))

    def finish(self) -> np.ndarray:
        """The samples the filter still holds; call once, after the last chunk."""
        return self._samples(self.resampler.resample(None))

    @staticmethod
    def _samples(frames: list[av.AudioFrame]) -> np.ndarray:
        arrays = [frame.to_ndarray().reshape(-1) for frame in frames]
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.float32)


class ResampledStreamEncoder:
    """A stream encoder fed at another rate than its own: each chunk is resampled first."""

    def __init__(self, encoder: StreamEncoder, resampler: StreamResampler) -> None:
        self.encoder = encoder
        self.resampler = resampler

    def encode(self, audio: np.ndarray) -> bytes:
        return self.encoder.encode(self.resampler.resample(audio))

    def finish(self) -> bytes:
        return self.encoder.encode(self.resampler.finish()) + self.encoder.finish()


def resample(audio: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """A whole signal at another rate (itself when the rates agree)."""
    if from_rate == to_rate:
        return audio
    resampler = StreamResampler(from_rate, to_rate)
    return np.concatenate([resampler.resample(audio), resampler.finish()])


def stream_encoder(
    format_name: str, sample_rate: int, bit_rate: int | None = None, input_rate: int | None = None
) -> StreamEncoder:
    """The encoder of a stream in the named format at `sample_rate`, fed chunks at `input_rate` (default the same), a
    lossy one at `bit_rate` (default its `LOSSY_BIT_RATES`); InvalidInputError if the format cannot stream."""
    fmt = audio_format(format_name, streaming=True)
    if fmt.codec is not None:
        encoder: StreamEncoder = CodecStreamEncoder(fmt, sample_rate, bit_rate)
    else:
        encoder = PcmStreamEncoder(streaming_wav_header(sample_rate) if fmt.name == "wav" else b"")
    if input_rate is None or input_rate == sample_rate:
        return encoder
    return ResampledStreamEncoder(encoder, StreamResampler(input_rate, sample_rate))


def encode_audio(audio: np.ndarray, sample_rate: int, format_name: str, bit_rate: int | None = None) -> bytes:
    """A complete file of `audio` (float32 [N], mono) in the named format (true sizes in its header)."""
    fmt = audio_format(format_name)
    if fmt.soundfile_format is None:  # pcm and the encoded formats: one stream over the whole signal
        encoder = stream_encoder(fmt.name, sample_rate, bit_rate)
        return encoder.encode(audio) + encoder.finish()
    major, subtype = fmt.soundfile_format
    buffer = io.BytesIO()
    sf.write(buffer, np.asarray(audio, dtype=np.float32), sample_rate, format=major, subtype=subtype)
    return buffer.getvalue()
