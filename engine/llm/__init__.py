"""LLM stage: encoded text -> speech tokens.

Takes a text encoding [T, D] float (prompt text + text) with the voice's speaker embedding [192] and prompt speech
tokens [P] int64; gives speech tokens [N] int64 (50 per second of audio for v1, 25 for CosyVoice2 and 3). Versions:
`transformer_lm` (v1 `TransformerLM`), `qwen2_lm` (CosyVoice2 `Qwen2LM`), `cosyvoice3_lm` (`CosyVoice3LM`).
`generation.TokenGenerator` batches any of them step by step (continuous batching, a KV cache per request);
`sampling` holds the official RAS sampling.
"""
