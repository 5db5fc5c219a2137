"""Vocoder stage: mel spectrogram -> waveform.

Takes mel [B, 80, F] with per-item lengths; gives float32 audio [B, F * hop] at the model rate (22.05 kHz v1,
24 kHz CosyVoice2 and 3). Versions: `hift` (`HiFTGenerator`, v1 and CosyVoice2), `causal_hift` (CosyVoice3's
`CausalHiFTGenerator`, which streams by re-running only the window that can change).
"""
