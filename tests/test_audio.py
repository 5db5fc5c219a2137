"""Response audio encoding: every writable format round-trips through libsndfile; streams decode whole."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from engine.errors import InvalidInputError
from serve_app.audio import (
    FORMATS,
    OPUS_SAMPLE_RATES,
    PCM_MAX,
    STREAM_FORMATS,
    audio_format,
    encode_audio,
    stream_prefix,
    to_pcm16,
)

SAMPLE_RATE = 22050
LOSSLESS = ("wav", "flac")


@pytest.fixture(scope="module")
def tone() -> np.ndarray:
    t = np.arange(SAMPLE_RATE // 2) / SAMPLE_RATE
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def test_the_always_available_formats_are_there() -> None:
    assert {"wav", "pcm", "flac"} <= set(FORMATS)
    assert set(STREAM_FORMATS) == {"wav", "pcm"}


def test_pcm16_scales_clips_and_is_little_endian() -> None:
    samples = np.frombuffer(to_pcm16(np.array([0.0, 0.5, -1.0, 2.0, -3.0], dtype=np.float32)), dtype="<i2")
    np.testing.assert_array_equal(samples, [0, round(0.5 * PCM_MAX), -PCM_MAX, PCM_MAX, -PCM_MAX])


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "pcm"])
def test_file_formats_decode_back(name: str, tone: np.ndarray) -> None:
    decoded, rate = sf.read(io.BytesIO(encode_audio(tone, SAMPLE_RATE, name)), dtype="float32")
    if name == "opus":
        assert rate in OPUS_SAMPLE_RATES and rate >= SAMPLE_RATE
    else:
        assert rate == SAMPLE_RATE
    duration = len(decoded) / rate
    assert abs(duration - len(tone) / SAMPLE_RATE) < 0.1  # lossy codecs pad a few frames
    assert np.isfinite(decoded).all()
    if name in LOSSLESS:
        np.testing.assert_allclose(decoded, tone, atol=1.5 / PCM_MAX)
    else:
        assert 0.2 < np.abs(decoded).max() < 0.8  # the tone's 0.5 amplitude survives the codec


def test_pcm_is_headerless_int16(tone: np.ndarray) -> None:
    assert encode_audio(tone, SAMPLE_RATE, "pcm") == to_pcm16(tone)


def test_streamed_wav_decodes_as_one_file(tone: np.ndarray) -> None:
    pieces = np.array_split(tone, 5)
    data = stream_prefix("wav", SAMPLE_RATE) + b"".join(to_pcm16(p) for p in pieces)
    decoded, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == SAMPLE_RATE
    np.testing.assert_allclose(decoded, tone, atol=1.5 / PCM_MAX)
    assert stream_prefix("pcm", SAMPLE_RATE) == b""


def test_unknown_and_unstreamable_formats_are_invalid_input() -> None:
    with pytest.raises(InvalidInputError, match="cannot be written"):
        audio_format("aac")
    with pytest.raises(InvalidInputError, match="cannot be streamed"):
        audio_format("flac", streaming=True)
    assert audio_format("wav", streaming=True).media_type == "audio/wav"
