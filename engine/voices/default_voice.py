"""The voice a model without built-in speakers (Fun-CosyVoice3) speaks OpenAI's voice names in until the operator
provisions voices of their own: the official zero-shot prompt recording with its transcript, shipped under its license
(`assets/README.md`)."""

from __future__ import annotations

from pathlib import Path

from engine.voices.registry import provisioned_voice_id

DEFAULT_VOICE_FILE = Path(__file__).parent / "assets" / "zero_shot_prompt.wav"
DEFAULT_VOICE_TRANSCRIPT = "希望你以后能够做的比我还好呦。"  # the official example.py's, for this recording
DEFAULT_VOICE_NAME = "CosyVoice zero-shot prompt"
DEFAULT_VOICE_ID = provisioned_voice_id("cosyvoice-default-voice")
