"""Voice cloning: a prompt recording -> the speaker embedding, speech tokens and mel that condition synthesis.

Reproduces the official zero-shot front end. The mono recording is resampled from its own rate straight to each
consumer's rate, as the official `load_wav` does:
* 16 kHz -> Kaldi fbank (80 bins, no dither) minus its mean over time -> `campplus.onnx` -> 192-dim embedding;
* 16 kHz -> Whisper log-mel (128 bins) -> the family's speech tokenizer (`speech_tokenizer_v1.onnx`: 50 tokens per
  second, `speech_tokenizer_v2.onnx` and `speech_tokenizer_v3.onnx`: 25) -> speech tokens;
* model rate -> the Matcha-TTS mel spectrogram the flow was trained on (80 bins) -> prompt mel frames.
An uploaded recording is checked on its header (sample rate, channels, length) before it is decoded, and only
rates whose resampling kernels are small are taken (`decode_prompt_audio`, `bounded_resample`).
A family whose flow upsamples tokens by a fixed ratio (CosyVoice2 and 3: 2) then trims tokens and frames to exactly
that many frames per token. What differs per family is its `CloningModels` (engine.voices.spec); a prompt records the
family it was made for, and only that family's models take it.
"""

from __future__ import annotations

import io
import math
import os
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime
import soundfile
import torch
import torchaudio.compliance.kaldi as kaldi
import torchaudio.functional as AF
from torch import Tensor, nn

from engine.errors import CheckpointError, InvalidInputError
from engine.families import ModelFamily, families
from engine.voices.spec import CAMPPLUS_FILE, MEL_BINS, PromptMelConfig

MIN_PROMPT_SECONDS = 1.0  # a shorter recording holds barely a word of the voice
MAX_PROMPT_SECONDS = 30.0  # the official speech tokenizer refuses longer audio
# The largest upload: the longest recording as it is likely sent, uncompressed (30 s of 48 kHz stereo WAV: 5.8 MB at
# 16 bits, 8.6 MB at 24), refused before it is read further; its header then bounds what is decoded.
MAX_PROMPT_AUDIO_BYTES = 10 << 20
MIN_SAMPLE_RATE = 16000  # the official loader refuses to upsample to the 16 kHz the tokenizer needs
# The rates an uploaded recording may have: each resamples to 16 kHz and to every model rate with a small kernel.
PROMPT_SAMPLE_RATES = (16000, 22050, 24000, 32000, 44100, 48000)
MAX_PROMPT_CHANNELS = 2
# torchaudio's sinc resampling kernel holds about (from / g) x (to / g) values for g = gcd(from, to): some 256
# million (gigabytes with its temporaries) from 16001 to 16000 Hz, 282240 from 32000 to 22050 Hz.
MAX_RESAMPLE_KERNEL = 1 << 20
FEATURE_SAMPLE_RATE = 16000  # rate of the embedding and speech-token features
EMBEDDING_DIM = 192

_WHISPER_MELS = 128
_WHISPER_N_FFT = 400
_WHISPER_HOP = 160
_WHISPER_LOG_FLOOR = 1e-10
_WHISPER_DYNAMIC_RANGE = 8.0  # log10 units kept below the loudest bin
_MATCHA_MAGNITUDE_EPS = 1e-9
_MATCHA_LOG_FLOOR = 1e-5


def slaney_mel_filters(sample_rate: int, n_fft: int, num_mels: int, fmin: float, fmax: float) -> Tensor:
    """Slaney-scale, area-normalised triangular filters (librosa's default) -> [num_mels, n_fft // 2 + 1]."""
    filters = AF.melscale_fbanks(
        n_freqs=n_fft // 2 + 1,
        f_min=fmin,
        f_max=fmax,
        n_mels=num_mels,
        sample_rate=sample_rate,
        norm="slaney",
        mel_scale="slaney",
    )
    return filters.T.contiguous()


class WhisperLogMel(nn.Module):
    """Whisper's `log_mel_spectrogram` at 16 kHz, the speech tokenizer's input."""

    def __init__(self, num_mels: int = _WHISPER_MELS) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(_WHISPER_N_FFT), persistent=False)
        filters = slaney_mel_filters(FEATURE_SAMPLE_RATE, _WHISPER_N_FFT, num_mels, 0.0, FEATURE_SAMPLE_RATE / 2)
        self.register_buffer("mel_filters", filters, persistent=False)

    def forward(self, waveform: Tensor) -> Tensor:
        """waveform [N] float32 at 16 kHz -> log-mel [num_mels, N // 160]."""
        spectrum = torch.stft(
            waveform, _WHISPER_N_FFT, _WHISPER_HOP, window=self.window, center=True, return_complex=True
        )
        power = spectrum[:, :-1].abs().pow(2)  # Whisper drops the last centred frame
        log_mel = torch.clamp(self.mel_filters @ power, min=_WHISPER_LOG_FLOOR).log10()
        log_mel = torch.maximum(log_mel, log_mel.max() - _WHISPER_DYNAMIC_RANGE)
        return (log_mel + 4.0) / 4.0


class PromptMelSpectrogram(nn.Module):
    """Matcha-TTS `mel_spectrogram`: the prompt mel frames the flow conditions on."""

    def __init__(self, config: PromptMelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("window", torch.hann_window(config.win_length), persistent=False)
        filters = slaney_mel_filters(
            config.sample_rate, config.n_fft, config.num_mels, config.fmin, config.upper_band_edge
        )
        self.register_buffer("mel_filters", filters, persistent=False)

    def forward(self, waveform: Tensor) -> Tensor:
        """waveform [N] float32 at the model rate -> log-mel [N // hop, num_mels]."""
        config = self.config
        padding = (config.n_fft - config.hop_length) // 2  # symmetric reflect padding instead of stft centring
        padded = torch.nn.functional.pad(waveform[None, None], (padding, padding), mode="reflect")[0, 0]
        spectrum = torch.stft(
            padded,
            config.n_fft,
            hop_length=config.hop_length,
            win_length=config.win_length,
            window=self.window,
            center=False,
            return_complex=True,
        )
        magnitude = torch.sqrt(spectrum.real.pow(2) + spectrum.imag.pow(2) + _MATCHA_MAGNITUDE_EPS)
        return torch.log(torch.clamp(self.mel_filters @ magnitude, min=_MATCHA_LOG_FLOOR)).T


def speaker_fbank(waveform_16k: Tensor) -> Tensor:
    """The campplus input: Kaldi fbank of [N] float32 16 kHz audio minus its mean over time -> [T, 80]."""
    fbank = kaldi.fbank(waveform_16k[None], num_mel_bins=MEL_BINS, dither=0.0, sample_frequency=FEATURE_SAMPLE_RATE)
    return fbank - fbank.mean(dim=0, keepdim=True)


def align_prompt(
    speech_tokens: np.ndarray, speech_feat: np.ndarray, frames_per_token: int
) -> tuple[np.ndarray, np.ndarray]:
    """CosyVoice2's rule: keep the longest prefix with exactly `frames_per_token` (n) mel frames [n P, 80] per token
    [P]."""
    token_count = min(speech_feat.shape[0] // frames_per_token, speech_tokens.shape[0])
    return speech_tokens[:token_count], speech_feat[: frames_per_token * token_count]


def bounded_resample(audio: Tensor, from_rate: int, to_rate: int) -> Tensor:
    """torchaudio's sinc resampling; InvalidInputError where its kernel would exceed MAX_RESAMPLE_KERNEL values."""
    divisor = math.gcd(from_rate, to_rate)
    _invalid_unless(
        (from_rate // divisor) * (to_rate // divisor) <= MAX_RESAMPLE_KERNEL,
        f"cannot resample the prompt recording from {from_rate} Hz to {to_rate} Hz in bounded memory; "
        f"send it at one of {_rates_list(PROMPT_SAMPLE_RATES)} Hz",
    )
    return AF.resample(audio, from_rate, to_rate)


def _rates_list(rates: tuple[int, ...]) -> str:
    return ", ".join(str(rate) for rate in rates)


@dataclass(frozen=True)
class PromptAudioLimits:
    """What an uploaded prompt recording may be (`decode_prompt_audio` checks its header before decoding)."""

    min_seconds: float = MIN_PROMPT_SECONDS
    max_seconds: float = MAX_PROMPT_SECONDS
    max_channels: int = MAX_PROMPT_CHANNELS
    sample_rates: tuple[int, ...] = PROMPT_SAMPLE_RATES

    def check_duration(self, seconds: float) -> None:
        _invalid_unless(
            self.min_seconds <= seconds <= self.max_seconds,
            f"the prompt recording lasts {seconds:.2f} s; it must last {self.min_seconds:g} to {self.max_seconds:g} s",
        )


_UNREADABLE_AUDIO = "not a readable audio file; send WAV, FLAC, OGG or MP3"
_SOUNDFILE_ERRORS = (soundfile.SoundFileError, RuntimeError, TypeError, ValueError)
_UNKNOWN_FRAMES = 2**63 - 1  # libsndfile's frame count of a file whose header does not give its length


def decode_prompt_audio(data: bytes, limits: PromptAudioLimits | None = None) -> tuple[np.ndarray, int]:
    """An uploaded recording (any format libsndfile reads) -> (its channel mean, float32 [N]; its sample rate).

    The header's sample rate, channel count and length are checked before any audio is decoded, and at most
    `limits.max_seconds` of it is decoded (a header may not give the length, or understate it): a small file of a
    long, many-channel or oddly sampled signal is refused instead of being expanded into gigabytes.
    """
    limits = limits or PromptAudioLimits()
    try:
        sound = soundfile.SoundFile(io.BytesIO(data))
    except _SOUNDFILE_ERRORS:
        # libsndfile's message names the in-memory file object, which means nothing to the uploader
        raise InvalidInputError(_UNREADABLE_AUDIO) from None
    with sound:
        rate, channels, frames = sound.samplerate, sound.channels, sound.frames
        _invalid_unless(
            rate in limits.sample_rates,
            f"the prompt recording's sample rate is {rate} Hz; it must be one of {_rates_list(limits.sample_rates)} Hz",
        )
        _invalid_unless(
            channels <= limits.max_channels,
            f"the prompt recording has {channels} channels; it may have at most {limits.max_channels}",
        )
        if frames != _UNKNOWN_FRAMES:
            limits.check_duration(frames / rate)
        max_frames = math.floor(limits.max_seconds * rate)
        try:
            waveform = sound.read(frames=max_frames + 1, dtype="float32", always_2d=True)
        except _SOUNDFILE_ERRORS:
            raise InvalidInputError(_UNREADABLE_AUDIO) from None
    _invalid_unless(
        len(waveform) <= max_frames,
        f"the prompt recording lasts more than {limits.max_seconds:g} s; it must last {limits.min_seconds:g} to "
        f"{limits.max_seconds:g} s",
    )
    limits.check_duration(len(waveform) / rate)  # the decoded length, whatever the header said
    return np.ascontiguousarray(waveform.mean(axis=1, dtype=np.float32)), rate


def _invalid_unless(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidInputError(message)


_PROMPT_ARRAYS = ("transcript", "embedding", "speech_tokens", "speech_feat", "sample_rate")
_FAMILY_ARRAY, _LEGACY_VERSION_ARRAY = "family", "version"  # files written before the family was recorded: version


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields have no boolean equality
class VoicePrompt:
    """Everything a cloned voice contributes to synthesis, for the models of one family."""

    transcript: str
    embedding: np.ndarray  # float32 [192]
    speech_tokens: np.ndarray  # int64 [P], of the family's speech tokenizer
    speech_feat: np.ndarray  # float32 [Tp, 80], at `sample_rate`
    sample_rate: int  # the model rate the mel was made for: the family's
    family: str  # the name of the model family it was made for (`ModelFamily.name`)

    def __post_init__(self) -> None:
        _invalid_unless(isinstance(self.transcript, str) and bool(self.transcript.strip()), "empty prompt transcript")
        _invalid_unless(
            _is_array(self.embedding, np.float32, (EMBEDDING_DIM,)) and bool(np.isfinite(self.embedding).all()),
            f"the speaker embedding must be finite float32 [{EMBEDDING_DIM}]",
        )
        _invalid_unless(_is_array(self.speech_tokens, np.int64, (None,)), "the prompt speech tokens must be int64 [P]")
        _invalid_unless(
            _is_array(self.speech_feat, np.float32, (None, MEL_BINS)) and bool(np.isfinite(self.speech_feat).all()),
            f"the prompt mel must be finite float32 [T, {MEL_BINS}]",
        )
        known = {family.name: family for family in families()}
        _invalid_unless(self.family in known, f"invalid prompt model family {self.family!r}")
        models = known[self.family].cloning
        _invalid_unless(models is not None, f"{self.family} models do not clone voices")
        family_rate = models.prompt_mel.sample_rate
        _invalid_unless(
            self.sample_rate == family_rate,
            f"a {self.family} prompt is made at {family_rate} Hz, not {self.sample_rate!r}",
        )

    def to_bytes(self) -> bytes:
        """The prompt as an npz file (no pickles)."""
        buffer = io.BytesIO()
        np.savez(
            buffer,
            allow_pickle=False,
            transcript=np.array(self.transcript, dtype=np.str_),
            embedding=self.embedding,
            speech_tokens=self.speech_tokens,
            speech_feat=self.speech_feat,
            sample_rate=np.array(self.sample_rate, dtype=np.int64),
            family=np.array(self.family, dtype=np.str_),
        )
        return buffer.getvalue()

    def save(self, path: Path) -> None:
        """Write an npz (no pickles) atomically: a temporary file beside `path`, then a rename over it."""
        path = Path(path)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(self.to_bytes())
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        finally:
            Path(temporary).unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> VoicePrompt:
        """Read a file written by `save`; InvalidInputError if it is corrupt, FileNotFoundError if it is missing."""
        return cls._from_arrays(_read_npz(Path(path), str(path)), str(path))

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> VoicePrompt:
        """Read the bytes of a file written by `save` (`name`: what error messages call it); InvalidInputError if
        they are corrupt."""
        return cls._from_arrays(_read_npz(io.BytesIO(data), name), name)

    @classmethod
    def _from_arrays(cls, arrays: dict[str, np.ndarray], path: str) -> VoicePrompt:
        transcript, sample_rate = arrays["transcript"], arrays["sample_rate"]
        _invalid_unless(transcript.shape == () and transcript.dtype.kind == "U", f"{path}: corrupt transcript")
        _invalid_unless(sample_rate.shape == () and sample_rate.dtype.kind in "iu", f"{path}: corrupt sample_rate")
        try:
            return cls(
                transcript=str(transcript[()]),
                embedding=arrays["embedding"],
                speech_tokens=arrays["speech_tokens"],
                speech_feat=arrays["speech_feat"],
                sample_rate=int(sample_rate),
                family=_family_of(arrays, path),
            )
        except InvalidInputError as error:
            raise InvalidInputError(f"{path}: corrupt voice prompt: {error.message}") from None


def _family_of(arrays: dict[str, np.ndarray], path: str) -> str:
    """The family a prompt file was made for: its `family`, or in a file written before that was recorded, the
    family of its `version` (1 or 2: no other family could clone then)."""
    family = arrays.get(_FAMILY_ARRAY)
    if family is not None:
        _invalid_unless(family.shape == () and family.dtype.kind == "U", f"{path}: corrupt family")
        return str(family[()])
    version = arrays[_LEGACY_VERSION_ARRAY]
    _invalid_unless(version.shape == () and version.dtype.kind in "iu", f"{path}: corrupt version")
    by_version = {family.version: family.name for family in families()}
    _invalid_unless(int(version) in by_version, f"{path}: invalid prompt CosyVoice version {int(version)}")
    return by_version[int(version)]


def _is_array(value: object, dtype: type, shape: tuple[int | None, ...]) -> bool:
    """Whether `value` is an ndarray of `dtype` whose shape matches `shape` (None: any length)."""
    return (
        isinstance(value, np.ndarray)
        and value.dtype == dtype
        and value.ndim == len(shape)
        and all(expected is None or actual == expected for actual, expected in zip(value.shape, shape, strict=True))
    )


def _read_npz(source: Path | io.BytesIO, path: str) -> dict[str, np.ndarray]:
    """The voice prompt arrays of an npz file (`path`: its name in messages); InvalidInputError for anything but a
    complete, pickle-free npz."""
    corrupt = (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error)
    try:
        archive = np.load(source, allow_pickle=False)
    except FileNotFoundError:
        raise
    except corrupt as error:
        raise InvalidInputError(f"{path} is not a readable voice prompt file: {error}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise InvalidInputError(f"{path} is not a voice prompt file (a single array, not an npz archive)")
    with archive:
        missing = [name for name in _PROMPT_ARRAYS if name not in archive.files]
        if _FAMILY_ARRAY not in archive.files and _LEGACY_VERSION_ARRAY not in archive.files:
            missing.append(_FAMILY_ARRAY)
        _invalid_unless(not missing, f"{path} is not a voice prompt file: missing {', '.join(missing)}")
        present = [name for name in (*_PROMPT_ARRAYS, _FAMILY_ARRAY, _LEGACY_VERSION_ARRAY) if name in archive.files]
        try:
            return {name: archive[name] for name in present}
        except corrupt as error:
            raise InvalidInputError(f"{path} is not a readable voice prompt file: {error}") from None


def _onnx_session(path: Path, num_threads: int, min_inputs: int) -> onnxruntime.InferenceSession:
    if not path.is_file():
        raise CheckpointError(f"voice cloning model {path} does not exist")
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = num_threads
    try:
        session = onnxruntime.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own untyped errors for unreadable models
        raise CheckpointError(f"cannot load voice cloning model {path}: {error}") from error
    if len(session.get_inputs()) < min_inputs:
        raise CheckpointError(f"{path} takes {len(session.get_inputs())} input(s); expected {min_inputs}")
    return session


class VoiceCloner:
    """Turns a prompt recording and its transcript into a `VoicePrompt` for one model (its family's cloning models)."""

    def __init__(
        self,
        campplus_path: Path,
        speech_tokenizer_path: Path,
        family: ModelFamily,
        model_sample_rate: int,
        num_threads: int = 1,
        speech_vocab_size: int | None = None,
    ) -> None:
        """`speech_vocab_size`: the model's speech vocabulary (None: the official one of its family)."""
        models = family.cloning_models()
        if model_sample_rate != models.prompt_mel.sample_rate:
            raise CheckpointError(
                f"{family.name} runs at {models.prompt_mel.sample_rate} Hz, not {model_sample_rate} Hz: "
                "unsupported model config"
            )
        self.family = family
        self.models = models
        self.speech_vocab_size = models.speech_vocab_size if speech_vocab_size is None else speech_vocab_size
        self.mel_config = models.prompt_mel
        self.speaker_session = _onnx_session(Path(campplus_path), num_threads, min_inputs=1)
        self.tokenizer_session = _onnx_session(Path(speech_tokenizer_path), num_threads, min_inputs=2)
        self.whisper_mel = WhisperLogMel()
        self.prompt_mel = PromptMelSpectrogram(self.mel_config)

    @classmethod
    def from_model_dir(
        cls, model_dir: Path, family: ModelFamily, model_sample_rate: int, speech_vocab_size: int | None = None
    ) -> VoiceCloner:
        """From an official model directory (`campplus.onnx` and the family's speech tokenizer)."""
        model_dir = Path(model_dir)
        paths = [model_dir / CAMPPLUS_FILE, model_dir / family.cloning_models().speech_tokenizer_file]
        missing = [path.name for path in paths if not path.is_file()]
        if missing:
            raise CheckpointError(f"voice cloning needs {' and '.join(missing)} in {model_dir}; not found")
        return cls(paths[0], paths[1], family, model_sample_rate, speech_vocab_size=speech_vocab_size)

    @property
    def sample_rate(self) -> int:
        return self.mel_config.sample_rate

    def clone(self, waveform: np.ndarray, sample_rate: int, transcript: str) -> VoicePrompt:
        """Features of a recording: `waveform` float32 [N] or [N, C] (channels are averaged) at `sample_rate`."""
        transcript = transcript.strip()
        _invalid_unless(bool(transcript), "the prompt transcript is empty: give the words spoken in the recording")
        mono = _mono_waveform(waveform, sample_rate)
        sample_rate = int(sample_rate)
        with torch.inference_mode():
            audio = torch.from_numpy(mono)
            audio_16k = bounded_resample(audio, sample_rate, FEATURE_SAMPLE_RATE)
            embedding = self._speaker_embedding(audio_16k)
            speech_tokens = self._speech_tokens(audio_16k)
            model_rate_audio = bounded_resample(audio, sample_rate, self.mel_config.sample_rate)
            speech_feat = self.prompt_mel(model_rate_audio).numpy()
        if self.models.frames_per_token is not None:
            speech_tokens, speech_feat = align_prompt(speech_tokens, speech_feat, self.models.frames_per_token)
        return VoicePrompt(
            transcript=transcript,
            embedding=embedding,
            speech_tokens=np.ascontiguousarray(speech_tokens),
            speech_feat=np.ascontiguousarray(speech_feat, dtype=np.float32),
            sample_rate=self.mel_config.sample_rate,
            family=self.family.name,
        )

    def _speaker_embedding(self, audio_16k: Tensor) -> np.ndarray:
        """[N] 16 kHz -> float32 [192]; campplus takes [1, T, 80]."""
        features = speaker_fbank(audio_16k)[None].numpy()
        input_name = self.speaker_session.get_inputs()[0].name
        embedding = np.asarray(self.speaker_session.run(None, {input_name: features})[0], dtype=np.float32).ravel()
        if embedding.shape != (EMBEDDING_DIM,):
            raise CheckpointError(f"the speaker model returned {embedding.size} values; expected {EMBEDDING_DIM}")
        return embedding

    def _speech_tokens(self, audio_16k: Tensor) -> np.ndarray:
        """[N] 16 kHz -> int64 [P]; the tokenizer takes log-mel [1, 128, T] and its length [1] int32."""
        log_mel = self.whisper_mel(audio_16k)[None].numpy()
        feats, lengths = (item.name for item in self.tokenizer_session.get_inputs()[:2])
        outputs = self.tokenizer_session.run(
            None, {feats: log_mel, lengths: np.array([log_mel.shape[2]], dtype=np.int32)}
        )
        tokens = np.asarray(outputs[0]).ravel().astype(np.int64)
        vocabulary = self.speech_vocab_size
        if tokens.size and not (tokens.min() >= 0 and tokens.max() < vocabulary):
            raise CheckpointError(
                f"the speech tokenizer returned tokens outside the model's speech vocabulary [0, {vocabulary}): "
                "is it the tokenizer of this model?"
            )
        return tokens


def _mono_waveform(waveform: np.ndarray, sample_rate: int) -> np.ndarray:
    """Checks a recording against the prompt limits; its channel mean as float32 [N]."""
    _invalid_unless(
        isinstance(sample_rate, (int, np.integer)) and sample_rate >= MIN_SAMPLE_RATE,
        f"the prompt recording's sample rate is {sample_rate} Hz; it must be at least {MIN_SAMPLE_RATE} Hz",
    )
    waveform = np.asarray(waveform)
    _invalid_unless(
        waveform.ndim in (1, 2) and waveform.dtype.kind == "f",
        f"the prompt waveform must be float [samples] or [samples, channels], not {waveform.dtype} {waveform.shape}",
    )
    mono = (waveform.mean(axis=1) if waveform.ndim == 2 else waveform).astype(np.float32)
    PromptAudioLimits().check_duration(mono.shape[0] / sample_rate)
    _invalid_unless(bool(np.isfinite(mono).all()), "the prompt recording contains NaN or infinite samples")
    _invalid_unless(bool(mono.any()), "the prompt recording is silent (all samples are zero)")
    return np.ascontiguousarray(mono)
