"""Reading response audio back in tests: every format but pcm through FFmpeg (PyAV), which also reads aac; and
writing small upload files that decode to much more audio."""

from __future__ import annotations

import io

import av
import numpy as np
import soundfile as sf


def decode_audio_file(data: bytes) -> tuple[np.ndarray, int]:
    """A wav, flac, mp3, opus or aac file -> (float32 mono samples, sample rate)."""
    with av.open(io.BytesIO(data)) as container:
        rate = container.streams.audio[0].rate
        frames = [frame.to_ndarray() for frame in container.decode(audio=0)]
    samples = np.concatenate([frame.reshape(-1) if frame.shape[0] == 1 else frame[0] for frame in frames])
    if samples.dtype.kind in "iu":
        samples = samples / np.iinfo(samples.dtype).max
    return samples.astype(np.float32), rate


def constant_flac(seconds: float, channels: int, sample_rate: int = 16000) -> bytes:
    """A FLAC file of a constant signal: it compresses to almost nothing (600 s x 8 channels: ~80 KB)."""
    buffer = io.BytesIO()
    block = np.full((1 << 20, channels), 0.25, dtype=np.float32)
    with sf.SoundFile(buffer, "w", sample_rate, channels, format="FLAC", subtype="PCM_16") as sound:
        for start in range(0, int(seconds * sample_rate), len(block)):
            sound.write(block[: int(seconds * sample_rate) - start])
    return buffer.getvalue()
