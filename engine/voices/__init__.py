"""Voices: the speakers a model knows and the ones cloned from a recording.

`speaker_bank.VoiceBank` (the official `spk2info.pt`: per voice an embedding [192] float32), `spec.CloningModels`
(what cloning needs of a family), `cloning` (a recording -> a `VoicePrompt`: embedding, speech tokens, prompt mel
[T, 80]) and `registry` (cloned voices kept on disk, shared by the encoder replicas and the ingress). The small ONNX
cloning models shipped for the tiny presets are made by `tools/make_tiny_voice_models.py`.
"""
