"""What voice cloning needs to know of a model family: its speech tokenizer and the flow's mel front end.

Each family (engine.families) names one `CloningModels`; engine.voices.cloning turns a recording into a prompt with it.
"""

from __future__ import annotations

from dataclasses import dataclass

MEL_BINS = 80
CAMPPLUS_FILE = "campplus.onnx"  # the speaker-embedding model every family clones with


@dataclass(frozen=True)
class PromptMelConfig:
    """The flow's mel front end (the yaml `feat_extractor`, Matcha-TTS `mel_spectrogram`)."""

    sample_rate: int
    n_fft: int
    hop_length: int
    win_length: int
    num_mels: int = MEL_BINS
    fmin: float = 0.0
    fmax: float | None = 8000.0  # None: half the sample rate (librosa's default for a yaml `fmax: null`)

    @property
    def upper_band_edge(self) -> float:
        return self.sample_rate / 2 if self.fmax is None else self.fmax


@dataclass(frozen=True)
class CloningModels:
    """What voice cloning needs to know about a model family (each family module registers one)."""

    version: int  # the family's version (the speech tokenizer's: speech_tokenizer_v<version>.onnx)
    speech_tokenizer_file: str  # the ONNX speech tokenizer in an official model dir
    speech_vocab_size: int  # the official speech vocabulary
    token_rate: int  # speech tokens per second
    prompt_mel: PromptMelConfig  # the flow's mel front end, at the model rate
    frames_per_token: int | None  # prompt alignment: None keeps tokens and frames as they are, n trims them to n:1
