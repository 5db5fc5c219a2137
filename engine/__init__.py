"""The CosyVoice engine: pure PyTorch, batch-first, no Ray.

Stages, in the order a request goes through them (each package's docstring says what it takes and gives):
`text` (frontend, tokenizers) -> `llm` (speech tokens) -> `flow` (mel) -> `vocoder` (waveform); `voices` holds the
speakers and voice cloning. `nn` holds the layers the stages share, `loading` reads yaml and checkpoints,
`families` names which stage classes make each CosyVoice version, and `runtime` runs the stages for requests
(the encoder and decoder stages, streaming, the decoder loop). docs/architecture.md draws the layers.
"""
