"""Reading response audio back in tests: every format but pcm through FFmpeg (PyAV), which also reads aac."""

from __future__ import annotations

import io

import av
import numpy as np


def decode_audio_file(data: bytes) -> tuple[np.ndarray, int]:
    """A wav, flac, mp3, opus or aac file -> (float32 mono samples, sample rate)."""
    with av.open(io.BytesIO(data)) as container:
        rate = container.streams.audio[0].rate
        frames = [frame.to_ndarray() for frame in container.decode(audio=0)]
    samples = np.concatenate([frame.reshape(-1) if frame.shape[0] == 1 else frame[0] for frame in frames])
    if samples.dtype.kind in "iu":
        samples = samples / np.iinfo(samples.dtype).max
    return samples.astype(np.float32), rate
