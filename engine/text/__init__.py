"""Text stage: a request's text -> sentences -> token ids (runs on the CPU encoder replicas).

`frontend.TextFrontend` normalizes and splits text and tokenizes each sentence to a list of int ids (whisper's
multilingual BPE for v1, `qwen_tokenizer.QwenTokenizer` for CosyVoice2 and 3). Its assets (the BPE ranks) ship in
`assets/`.
"""
