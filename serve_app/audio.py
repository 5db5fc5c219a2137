"""Encoding float32 waveforms into the response formats, whole or as a stream of chunks.

wav, flac, mp3 and opus go through libsndfile (mp3 and opus only where the installed libsndfile
writes them); pcm is raw 16-bit little-endian mono, as in OpenAI's API. Only wav and pcm can be
streamed: the others need the whole signal (flac rewrites its header, opus resamples).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF

from engine.errors import InvalidInputError

# libsndfile writes Opus only at these rates; other rates are resampled to the next one up.
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)
PCM_MAX = 32767


@dataclass(frozen=True)
class AudioFormat:
    name: str
    media_type: str
    container: str | None  # libsndfile major format; None for raw pcm
    subtype: str
    streamable: bool


_KNOWN_FORMATS = (
    AudioFormat("wav", "audio/wav", "WAV", "PCM_16", streamable=True),
    AudioFormat("pcm", "audio/pcm", None, "PCM_16", streamable=True),
    AudioFormat("flac", "audio/flac", "FLAC", "PCM_16", streamable=False),
    AudioFormat("mp3", "audio/mpeg", "MP3", "MPEG_LAYER_III", streamable=False),
    AudioFormat("opus", "audio/ogg", "OGG", "OPUS", streamable=False),
)


def _writable(fmt: AudioFormat) -> bool:
    if fmt.container is None:
        return True
    return fmt.container in sf.available_formats() and fmt.subtype in sf.available_subtypes(fmt.container)


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


def _resample(audio: np.ndarray, sample_rate: int, target_rate: int) -> np.ndarray:
    if sample_rate == target_rate:
        return audio
    return AF.resample(torch.from_numpy(np.ascontiguousarray(audio)), sample_rate, target_rate).numpy()


def encode_audio(audio: np.ndarray, sample_rate: int, format_name: str) -> bytes:
    """A complete file of `audio` (float32 [N], mono) in the named format."""
    fmt = audio_format(format_name)
    if fmt.container is None:
        return to_pcm16(audio)
    if fmt.name == "opus":
        target = next((rate for rate in OPUS_SAMPLE_RATES if rate >= sample_rate), OPUS_SAMPLE_RATES[-1])
        audio, sample_rate = _resample(audio, sample_rate, target), target
    buffer = io.BytesIO()
    sf.write(buffer, np.asarray(audio, dtype=np.float32), sample_rate, format=fmt.container, subtype=fmt.subtype)
    return buffer.getvalue()


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


def stream_prefix(format_name: str, sample_rate: int) -> bytes:
    """Bytes sent before the first chunk of a stream (the WAV header; nothing for pcm)."""
    fmt = audio_format(format_name, streaming=True)
    return streaming_wav_header(sample_rate) if fmt.name == "wav" else b""
