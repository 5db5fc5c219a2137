"""Voices: the speakers a model knows and the ones cloned from a recording.

`speaker_bank.VoiceBank` (the official `spk2info.pt`: per voice an embedding [192] float32), `spec.CloningModels`
(what cloning needs of a family), `cloning` (a recording -> a `VoicePrompt`: embedding, speech tokens, prompt mel
[T, 80]), `registry` (cloned voices kept on disk, shared by the encoder replicas and the ingress) and
`tiny_models` (the small ONNX cloning models shipped for the tiny presets).
"""
