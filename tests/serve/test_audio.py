"""Response audio encoding: every format decodes back, whole or streamed, and the streamed ones emit bytes
before the signal ends."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import soundfile as sf

from engine.errors import InvalidInputError
from serve_app.audio import (
    FORMATS,
    LOSSY_BIT_RATES,
    OPENAI_SAMPLE_RATE,
    OPUS_SAMPLE_RATES,
    PCM_MAX,
    STREAM_FORMATS,
    StreamResampler,
    audio_format,
    encode_audio,
    resample,
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


def _peak_hz(audio: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(audio))
    return float(np.fft.rfftfreq(len(audio), 1 / rate)[np.argmax(spectrum)])


def test_resampling_keeps_pitch_and_length_and_chunks_join_as_the_whole(tone: np.ndarray) -> None:
    whole = resample(tone, SAMPLE_RATE, OPENAI_SAMPLE_RATE)
    assert abs(len(whole) - OPENAI_SAMPLE_RATE) <= 64  # one second stays one second
    assert abs(_peak_hz(whole, OPENAI_SAMPLE_RATE) - 440) <= 1.0
    resampler = StreamResampler(SAMPLE_RATE, OPENAI_SAMPLE_RATE)
    chunks = [resampler.resample(chunk) for chunk in np.array_split(tone, 7)] + [resampler.finish()]
    np.testing.assert_allclose(np.concatenate(chunks), whole, atol=1e-6)
    assert resample(tone, SAMPLE_RATE, SAMPLE_RATE) is tone


def test_a_resampled_stream_decodes_at_the_rate_asked(tone: np.ndarray) -> None:
    encoder = stream_encoder("wav", OPENAI_SAMPLE_RATE, input_rate=SAMPLE_RATE)
    data = b"".join(encoder.encode(chunk) for chunk in np.array_split(tone, 5)) + encoder.finish()
    audio, rate = decode_audio_file(data)
    assert rate == OPENAI_SAMPLE_RATE and abs(len(audio) - OPENAI_SAMPLE_RATE) <= 64


@pytest.mark.parametrize(("name", "bit_rate"), [("mp3", 160_000), ("aac", 96_000), ("opus", 64_000)])
def test_lossy_formats_are_encoded_at_their_bit_rate(name: str, bit_rate: int) -> None:
    assert LOSSY_BIT_RATES[name] == bit_rate
    t = np.arange(4 * OPENAI_SAMPLE_RATE) / OPENAI_SAMPLE_RATE  # 4 s: container overhead is small beside the audio
    signal = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * np.random.default_rng(0).standard_normal(len(t))).astype(
        np.float32
    )
    data = encode_audio(signal, OPENAI_SAMPLE_RATE, name)  # at its LOSSY_BIT_RATES rate
    measured = len(data) * 8 / 4.0
    assert 0.75 * bit_rate <= measured <= 1.25 * bit_rate, measured  # the size the bit rate gives, give or take
    low = encode_audio(signal, OPENAI_SAMPLE_RATE, name, bit_rate // 2)
    assert len(low) < 0.75 * len(data)


def test_a_whole_wav_has_its_true_sizes_and_a_streamed_one_the_open_header(tone: np.ndarray) -> None:
    with wave.open(io.BytesIO(encode_audio(tone, SAMPLE_RATE, "wav"))) as whole:
        assert whole.getnframes() == len(tone)
    encoder = stream_encoder("wav", SAMPLE_RATE)
    streamed = encoder.encode(tone) + encoder.finish()
    assert streamed[4:8] == b"\xff\xff\xff\xff"  # RIFF size unknown: read to the end
