"""Response audio encoding: every format decodes back, whole or streamed, and the streamed ones emit bytes
before the signal ends."""

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
    stream_encoder,
    to_pcm16,
)
from tests.serve.conftest import decode_audio_file

SAMPLE_RATE = 22050
LOSSLESS = ("wav", "flac")
ENCODED = ("mp3", "opus", "aac")


@pytest.fixture(scope="module")
def tone() -> np.ndarray:
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def test_the_installed_formats_are_there() -> None:
    assert set(FORMATS) == {"wav", "pcm", "flac", *ENCODED}  # PyAV is a dependency
    assert set(STREAM_FORMATS) == {"wav", "pcm", *ENCODED}


def test_pcm16_scales_clips_and_is_little_endian() -> None:
    samples = np.frombuffer(to_pcm16(np.array([0.0, 0.5, -1.0, 2.0, -3.0], dtype=np.float32)), dtype="<i2")
    np.testing.assert_array_equal(samples, [0, round(0.5 * PCM_MAX), -PCM_MAX, PCM_MAX, -PCM_MAX])


def _check_decodes_to(data: bytes, name: str, tone: np.ndarray) -> None:
    decoded, rate = decode_audio_file(data)
    if name == "opus":
        assert rate in OPUS_SAMPLE_RATES and rate >= SAMPLE_RATE
    else:
        assert rate == SAMPLE_RATE
    assert abs(len(decoded) / rate - len(tone) / SAMPLE_RATE) < 0.1  # lossy codecs pad a few frames
    assert np.isfinite(decoded).all()
    if name in LOSSLESS:
        np.testing.assert_allclose(decoded, tone, atol=1.5 / PCM_MAX)
    else:
        assert 0.3 < np.abs(decoded).max() < 0.7  # the tone's 0.5 amplitude survives the codec


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "pcm"])
def test_file_formats_decode_back(name: str, tone: np.ndarray) -> None:
    _check_decodes_to(encode_audio(tone, SAMPLE_RATE, name), name, tone)


def test_wav_and_flac_files_are_plain_libsndfile_files(tone: np.ndarray) -> None:
    for name in LOSSLESS:
        decoded, rate = sf.read(io.BytesIO(encode_audio(tone, SAMPLE_RATE, name)), dtype="float32")
        assert rate == SAMPLE_RATE and len(decoded) == len(tone)


def test_pcm_is_headerless_int16(tone: np.ndarray) -> None:
    assert encode_audio(tone, SAMPLE_RATE, "pcm") == to_pcm16(tone)


@pytest.mark.parametrize("name", [n for n in STREAM_FORMATS if n != "pcm"])
def test_streams_emit_bytes_early_and_decode_as_one_file(name: str, tone: np.ndarray) -> None:
    encoder = stream_encoder(name, SAMPLE_RATE)
    pieces = [encoder.encode(chunk) for chunk in np.array_split(tone, 10)]
    assert sum(1 for piece in pieces[:-1] if piece) >= 5, "the encoder held the audio back until the end"
    _check_decodes_to(b"".join(pieces) + encoder.finish(), name, tone)


def test_streamed_pcm_is_the_samples(tone: np.ndarray) -> None:
    encoder = stream_encoder("pcm", SAMPLE_RATE)
    data = b"".join(encoder.encode(chunk) for chunk in np.array_split(tone, 3)) + encoder.finish()
    assert data == to_pcm16(tone)


def test_unknown_and_unstreamable_formats_are_invalid_input() -> None:
    with pytest.raises(InvalidInputError, match="cannot be written"):
        audio_format("ogg")
    with pytest.raises(InvalidInputError, match="cannot be streamed"):
        audio_format("flac", streaming=True)
    with pytest.raises(InvalidInputError, match="cannot be streamed"):
        stream_encoder("flac", SAMPLE_RATE)
    assert audio_format("aac").media_type == "audio/aac"
