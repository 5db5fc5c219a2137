"""Voice cloning features (engine.voices.cloning) on tiny stand-in ONNX models and synthetic recordings."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from engine.errors import CheckpointError, InvalidInputError
from engine.families import COSYVOICE1, COSYVOICE2, COSYVOICE3
from engine.families.base import ModelConfig
from engine.loading.loader import PRESET_VOICE_MODELS, PRESETS, PRESETS_DIR
from engine.voices.cloning import (
    MAX_PROMPT_SECONDS,
    VoiceCloner,
    VoicePrompt,
    WhisperLogMel,
    align_prompt,
    decode_prompt_audio,
)
from engine.voices.spec import PromptMelConfig
from tools.make_tiny_voice_models import write_tiny_voice_models

MODEL_RATES = {1: 22050, 2: 24000, 3: 24000}
FAMILIES = {1: COSYVOICE1, 2: COSYVOICE2, 3: COSYVOICE3}
CLONING = {version: family.cloning_models() for version, family in FAMILIES.items()}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    directories = {}
    for version in MODEL_RATES:
        directories[version] = tmp_path_factory.mktemp(f"voice_models_v{version}")
        write_tiny_voice_models(directories[version], CLONING[version])
    return directories


@pytest.fixture(scope="module")
def cloners(model_dirs: dict[int, Path]) -> dict[int, VoiceCloner]:
    return {
        version: VoiceCloner.from_model_dir(path, FAMILIES[version], MODEL_RATES[version])
        for version, path in model_dirs.items()
    }


def voice(pitch_hz: float, seconds: float = 3.0, sample_rate: int = 16000, seed: int = 0) -> np.ndarray:
    """A voice-like test signal: a few harmonics of `pitch_hz` under a syllable-rate envelope, plus a little noise."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    harmonics = sum(np.sin(2 * np.pi * k * pitch_hz * t) / k for k in range(1, 6))
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 3.0 * t)
    noise = np.random.default_rng(seed).standard_normal(t.shape)
    return (0.2 * envelope * harmonics + 0.01 * noise).astype(np.float32)


# --- independent references (numpy, float64) ------------------------------------------------------------


def _slaney_hz_to_mel(hz: np.ndarray) -> np.ndarray:
    linear_step, log_start_hz, log_step = 200.0 / 3, 1000.0, np.log(6.4) / 27.0
    log_region = (log_start_hz / linear_step) + np.log(np.maximum(hz, log_start_hz) / log_start_hz) / log_step
    return np.where(hz >= log_start_hz, log_region, hz / linear_step)


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    linear_step, log_start_hz, log_step = 200.0 / 3, 1000.0, np.log(6.4) / 27.0
    log_start_mel = log_start_hz / linear_step
    return np.where(mel >= log_start_mel, log_start_hz * np.exp(log_step * (mel - log_start_mel)), mel * linear_step)


def reference_mel_filters(sample_rate: int, n_fft: int, num_mels: int, fmax: float) -> np.ndarray:
    """Slaney triangles with area normalisation -> [num_mels, n_fft // 2 + 1]."""
    bin_hz = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges = _slaney_mel_to_hz(np.linspace(0.0, _slaney_hz_to_mel(np.array(fmax)), num_mels + 2))
    rising = (bin_hz[None] - edges[:-2, None]) / (edges[1:-1] - edges[:-2])[:, None]
    falling = (edges[2:, None] - bin_hz[None]) / (edges[2:] - edges[1:-1])[:, None]
    return np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (edges[2:] - edges[:-2]))[:, None]


def _framed_spectrum(signal: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann
    starts = range(0, len(signal) - n_fft + 1, hop)
    return np.fft.rfft(np.stack([signal[start : start + n_fft] * window for start in starts]), axis=1)


def reference_matcha_mel(wave: np.ndarray, config: PromptMelConfig) -> np.ndarray:
    """The Matcha-TTS formula -> [T, 80]."""
    padding = (config.n_fft - config.hop_length) // 2
    spectrum = _framed_spectrum(
        np.pad(wave.astype(np.float64), padding, mode="reflect"), config.n_fft, config.hop_length
    )
    magnitude = np.sqrt(spectrum.real**2 + spectrum.imag**2 + 1e-9)
    fmax = config.sample_rate / 2 if config.fmax is None else config.fmax  # librosa's default for None
    filters = reference_mel_filters(config.sample_rate, config.n_fft, 80, fmax)
    return np.log(np.maximum(magnitude @ filters.T, 1e-5))


def reference_whisper_log_mel(wave: np.ndarray) -> np.ndarray:
    """Whisper's formula at 16 kHz -> [128, N // 160]."""
    spectrum = _framed_spectrum(np.pad(wave.astype(np.float64), 200, mode="reflect"), 400, 160)[:-1]
    log_mel = np.log10(np.maximum(np.abs(spectrum) ** 2 @ reference_mel_filters(16000, 400, 128, 8000.0).T, 1e-10))
    return ((np.maximum(log_mel, log_mel.max() - 8.0) + 4.0) / 4.0).T


# --- features ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "input_rate"), [(1, 16000), (1, 44100), (2, 16000), (2, 48000), (3, 16000), (3, 44100)]
)
def test_shapes_dtypes_and_token_rate(cloners: dict[int, VoiceCloner], version: int, input_rate: int) -> None:
    prompt = cloners[version].clone(voice(140.0, seconds=3.0, sample_rate=input_rate), input_rate, " Hello there. ")
    tokens_per_second = {1: 50, 2: 25, 3: 25}[version]
    assert prompt.transcript == "Hello there."
    assert (prompt.sample_rate, prompt.family) == (MODEL_RATES[version], FAMILIES[version].name)
    assert prompt.embedding.dtype == np.float32 and prompt.embedding.shape == (192,)
    assert prompt.speech_tokens.dtype == np.int64 and prompt.speech_tokens.shape == (3 * tokens_per_second,)
    assert prompt.speech_tokens.min() >= 0 and prompt.speech_tokens.max() < {1: 4096, 2: 6561, 3: 6561}[version]
    assert prompt.speech_feat.dtype == np.float32
    hop = {1: 256, 2: 480, 3: 480}[version]
    assert prompt.speech_feat.shape == (3 * MODEL_RATES[version] // hop, 80)
    if version > 1:  # v2 and v3 keep 2 mel frames per token
        assert prompt.speech_feat.shape[0] == 2 * prompt.speech_tokens.shape[0]


def test_v2_alignment_keeps_two_frames_per_token() -> None:
    tokens = np.arange(10, dtype=np.int64)
    feat = np.arange(25 * 80, dtype=np.float32).reshape(25, 80)
    kept_tokens, kept_feat = align_prompt(tokens, feat, 2)  # more frames than 2 per token: frames are cut
    np.testing.assert_array_equal(kept_tokens, tokens)
    np.testing.assert_array_equal(kept_feat, feat[:20])
    kept_tokens, kept_feat = align_prompt(tokens, feat[:15], 2)  # fewer: tokens are cut too, to 15 // 2
    np.testing.assert_array_equal(kept_tokens, tokens[:7])
    np.testing.assert_array_equal(kept_feat, feat[:14])


@pytest.mark.parametrize("version", [1, 2, 3])
def test_prompt_mel_matches_matcha_formula(cloners: dict[int, VoiceCloner], version: int) -> None:
    rate = MODEL_RATES[version]
    t = np.arange(int(2.5 * rate)) / rate
    noise = np.random.default_rng(3).standard_normal(t.shape)
    wave = (0.5 * np.sin(2 * np.pi * 440.0 * t) + 0.01 * noise).astype(np.float32)
    prompt = cloners[version].clone(wave, rate, "a sine")  # already at the model rate: no resampling
    expected = reference_matcha_mel(wave, cloners[version].mel_config)
    assert expected.shape[0] == len(wave) // cloners[version].mel_config.hop_length
    frames = prompt.speech_feat.shape[0]
    assert frames == (expected.shape[0] if version == 1 else 2 * (expected.shape[0] // 2))
    if version == 3:  # fmax null: the filters reach 12 kHz, where v2's stop at 8 kHz
        assert cloners[version].mel_config.upper_band_edge == 12000.0
    np.testing.assert_allclose(prompt.speech_feat, expected[:frames], atol=2e-4)
    assert prompt.speech_feat.max() - prompt.speech_feat.min() > 5.0  # the sine's band stands out


def test_whisper_log_mel_matches_reference() -> None:
    wave = voice(180.0, seconds=1.5)
    with torch.inference_mode():
        log_mel = WhisperLogMel()(torch.from_numpy(wave)).numpy()
    expected = reference_whisper_log_mel(wave)
    assert log_mel.shape == expected.shape == (128, len(wave) // 160)
    np.testing.assert_allclose(log_mel, expected, atol=2e-4)


def test_embedding_is_deterministic_and_tells_voices_apart(
    cloners: dict[int, VoiceCloner], model_dirs: dict[int, Path]
) -> None:
    low, high = voice(110.0), voice(230.0)
    first = cloners[1].clone(low, 16000, "hi")
    np.testing.assert_array_equal(first.embedding, cloners[1].clone(low, 16000, "hi").embedding)
    fresh = VoiceCloner(model_dirs[1] / "campplus.onnx", model_dirs[1] / "speech_tokenizer_v1.onnx", COSYVOICE1, 22050)
    again = fresh.clone(low, 16000, "hi")
    np.testing.assert_array_equal(first.embedding, again.embedding)
    np.testing.assert_array_equal(first.speech_tokens, again.speech_tokens)
    np.testing.assert_array_equal(first.speech_feat, again.speech_feat)
    other = cloners[1].clone(high, 16000, "hi")
    assert np.linalg.norm(first.embedding - other.embedding) > 0.1 * np.linalg.norm(first.embedding)
    assert not np.array_equal(first.speech_tokens, other.speech_tokens)


def test_channels_are_averaged(cloners: dict[int, VoiceCloner]) -> None:
    wave = voice(150.0, seconds=1.5)
    stereo = np.stack([wave, np.zeros_like(wave)], axis=1)  # [N, 2]: the mono mix is half the left channel
    from_stereo, from_mono = cloners[2].clone(stereo, 16000, "x"), cloners[2].clone(wave * 0.5, 16000, "x")
    np.testing.assert_allclose(from_stereo.embedding, from_mono.embedding, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(from_stereo.speech_tokens, from_mono.speech_tokens)
    np.testing.assert_allclose(from_stereo.speech_feat, from_mono.speech_feat, atol=1e-5)


# --- limits -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("waveform", "sample_rate", "transcript", "message"),
    [
        (voice(150.0, seconds=0.5), 16000, "hi", "the prompt recording lasts 0.50 s; it must last 1 to 30 s"),
        (voice(150.0, seconds=MAX_PROMPT_SECONDS + 0.5), 16000, "hi", "lasts 30.50 s; it must last 1 to 30 s"),
        (voice(150.0, sample_rate=8000), 8000, "hi", "sample rate is 8000 Hz; it must be at least 16000 Hz"),
        (voice(150.0), 16000, "  \n", "the prompt transcript is empty"),
        (np.zeros(32000, dtype=np.float32), 16000, "hi", "the prompt recording is silent (all samples are zero)"),
        (np.full(32000, np.nan, dtype=np.float32), 16000, "hi", "contains NaN or infinite samples"),
        (np.ones(32000, dtype=np.int16), 16000, "hi", "must be float [samples] or [samples, channels], not int16"),
        (np.ones((1, 32000, 1), dtype=np.float32), 16000, "hi", "not float32 (1, 32000, 1)"),
    ],
)
def test_limits(
    cloners: dict[int, VoiceCloner], waveform: np.ndarray, sample_rate: int, transcript: str, message: str
) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        cloners[1].clone(waveform, sample_rate, transcript)


# --- VoicePrompt files ------------------------------------------------------------------------------------


def test_save_load_round_trip(cloners: dict[int, VoiceCloner], tmp_path: Path) -> None:
    prompt = cloners[2].clone(voice(200.0, seconds=1.2), 16000, "你好, world")
    path = tmp_path / "voice.npz"
    prompt.save(path)
    assert [entry.name for entry in tmp_path.iterdir()] == ["voice.npz"], "no temporary file may be left behind"
    loaded = VoicePrompt.load(path)
    assert (loaded.transcript, loaded.sample_rate, loaded.family) == ("你好, world", 24000, "CosyVoice2")
    for name in ("embedding", "speech_tokens", "speech_feat"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(prompt, name))
        assert getattr(loaded, name).dtype == getattr(prompt, name).dtype


def test_a_v3_prompt_records_its_family_through_a_file(cloners: dict[int, VoiceCloner], tmp_path: Path) -> None:
    prompt = cloners[3].clone(voice(200.0, seconds=1.2), 16000, "hi")
    prompt.save(tmp_path / "voice.npz")
    assert VoicePrompt.load(tmp_path / "voice.npz").family == "CosyVoice3"  # the same rate as v2, told apart


@pytest.mark.parametrize(("version", "family"), [(1, "CosyVoice v1"), (2, "CosyVoice2")])
def test_a_file_written_before_families_were_recorded_loads_with_its_versions_family(
    tmp_path: Path, version: int, family: str
) -> None:
    path = tmp_path / "voice.npz"
    arrays = {name: array for name, array in _valid_arrays().items() if name != "family"}
    np.savez(path, **{**arrays, "sample_rate": np.array(MODEL_RATES[version]), "version": np.array(version)})
    assert VoicePrompt.load(path).family == family


def test_the_family_and_its_rate_are_checked() -> None:
    arrays = {
        "embedding": np.zeros(192, np.float32),
        "speech_tokens": np.zeros(4, np.int64),
        "speech_feat": np.zeros((8, 80), np.float32),
    }
    assert VoicePrompt("hi", sample_rate=24000, family="CosyVoice3", **arrays).family == "CosyVoice3"
    with pytest.raises(InvalidInputError, match=r"a CosyVoice v1 prompt is made at 22050 Hz, not 24000"):
        VoicePrompt("hi", sample_rate=24000, family="CosyVoice v1", **arrays)
    with pytest.raises(InvalidInputError, match="invalid prompt model family 'CosyVoice9'"):
        VoicePrompt("hi", sample_rate=24000, family="CosyVoice9", **arrays)
    with pytest.raises(InvalidInputError, match="speaker embedding must be finite float32"):
        VoicePrompt("hi", sample_rate=24000, family="CosyVoice3", **{**arrays, "embedding": np.zeros(192, np.float64)})


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _valid_arrays() -> dict[str, np.ndarray]:
    return {
        "transcript": np.array("hi"),
        "embedding": np.zeros(192, np.float32),
        "speech_tokens": np.zeros(4, np.int64),
        "speech_feat": np.zeros((8, 80), np.float32),
        "sample_rate": np.array(22050),
        "family": np.array("CosyVoice v1"),
    }


BAD_PROMPT_ARRAYS = {  # expected message -> changed arrays (None: left out)
    "missing family": {"family": None},
    "the prompt mel must be finite float32 [T, 80]": {"speech_feat": np.zeros((8, 81), np.float32)},
    "the prompt speech tokens must be int64 [P]": {"speech_tokens": np.zeros(4, np.int32)},
    "corrupt transcript": {"transcript": np.array(3)},
    "corrupt family": {"family": np.array(3)},
    "invalid prompt model family 'Other'": {"family": np.array("Other")},
    "invalid prompt CosyVoice version 7": {"family": None, "version": np.array(7)},
}


@pytest.mark.parametrize(("message", "changes"), BAD_PROMPT_ARRAYS.items())
def test_load_rejects_bad_arrays(tmp_path: Path, message: str, changes: dict[str, np.ndarray | None]) -> None:
    path = tmp_path / "voice.npz"
    np.savez(path, **{name: array for name, array in {**_valid_arrays(), **changes}.items() if array is not None})
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        VoicePrompt.load(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"definitely not an npz archive", "is not a readable voice prompt file"), (_npy_bytes(np.zeros(3)), "a single")],
)
def test_load_rejects_other_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "voice.npz"
    path.write_bytes(content)
    with pytest.raises(InvalidInputError, match=message):
        VoicePrompt.load(path)


def test_load_rejects_truncated_file_and_reports_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "voice.npz"
    np.savez(path, **_valid_arrays())
    assert VoicePrompt.load(path).speech_tokens.shape == (4,)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(InvalidInputError, match="is not a readable voice prompt file"):
        VoicePrompt.load(path)
    with pytest.raises(FileNotFoundError):
        VoicePrompt.load(tmp_path / "absent.npz")


# --- audio decoding and model files -----------------------------------------------------------------------


def test_decode_audio_of_wav_and_flac() -> None:
    wave = voice(150.0, seconds=1.0, sample_rate=22050)
    buffer = io.BytesIO()
    soundfile.write(buffer, wave, 22050, format="WAV", subtype="PCM_16")
    decoded, rate = decode_prompt_audio(buffer.getvalue())
    assert rate == 22050 and decoded.dtype == np.float32 and decoded.shape == wave.shape
    np.testing.assert_allclose(decoded, wave, atol=1.0 / 32768)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.stack([wave, 0.5 * wave], axis=1), 22050, format="FLAC")
    decoded, rate = decode_prompt_audio(buffer.getvalue())  # the channels' mean
    assert rate == 22050 and decoded.shape == wave.shape
    np.testing.assert_allclose(decoded, 0.75 * wave, atol=1.0 / 32768)


@pytest.mark.parametrize("data", [b"", b"RIFF\x00\x00garbage that is not audio at all"])
def test_decode_audio_rejects_garbage(data: bytes) -> None:
    with pytest.raises(InvalidInputError, match=r"^not a readable audio file"):
        decode_prompt_audio(data)


def test_model_file_errors(tmp_path: Path, model_dirs: dict[int, Path]) -> None:
    with pytest.raises(CheckpointError, match=re.escape("needs campplus.onnx and speech_tokenizer_v2.onnx in")):
        VoiceCloner.from_model_dir(tmp_path, COSYVOICE2, 24000)
    with pytest.raises(CheckpointError, match=re.escape("needs speech_tokenizer_v3.onnx in")):
        VoiceCloner.from_model_dir(model_dirs[2], COSYVOICE3, 24000)
    with pytest.raises(CheckpointError, match="CosyVoice v1 runs at 22050 Hz, not 24000 Hz"):
        VoiceCloner.from_model_dir(model_dirs[1], COSYVOICE1, 24000)
    broken = tmp_path / "campplus.onnx"
    broken.write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match="cannot load voice cloning model"):
        VoiceCloner(broken, model_dirs[1] / "speech_tokenizer_v1.onnx", COSYVOICE1, 22050)


def test_tokens_beyond_the_models_speech_vocabulary_are_a_configuration_error(model_dirs: dict[int, Path]) -> None:
    small = VoiceCloner.from_model_dir(model_dirs[2], COSYVOICE2, 24000, speech_vocab_size=4)  # 4 speech tokens
    with pytest.raises(CheckpointError, match="tokenizer of this model"):
        small.clone(voice(110.0), 16000, "hi")


def test_the_shipped_preset_models_are_what_the_generator_writes(tmp_path: Path) -> None:
    for preset, directory in PRESET_VOICE_MODELS.items():
        config = ModelConfig.from_yaml_file(PRESETS_DIR / PRESETS[preset])
        write_tiny_voice_models(tmp_path / preset, config.family.cloning_models(), config.flow.vocab_size)
        for generated in (tmp_path / preset).iterdir():
            assert (directory / generated.name).read_bytes() == generated.read_bytes(), f"{preset}: {generated.name}"
