"""`EncodedSegment`: one sentence as the encoder stage hands it to the decoder stage (plain numpy, picklable)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.llm.sampling import SamplingOptions


@dataclass
class EncodedSegment:
    """One sentence, encoded on the CPU side, ready for the decoder. Numpy only (zero-copy across Ray)."""

    text_encoded: np.ndarray  # [T, D_llm] float32: text encoder output over (prompt text + text)
    text_len: int  # target text tokens (without the prompt), sets min/max speech length
    llm_embedding: np.ndarray | None  # [192] speaker x-vector for the LLM; None in instruct mode
    flow_embedding: np.ndarray  # [192] speaker x-vector for the flow
    llm_prompt_speech_tokens: np.ndarray  # [P] int64 prompt speech tokens leading the LLM's speech (zero-shot)
    flow_prompt_speech_tokens: np.ndarray  # [P'] int64 prompt speech tokens of the flow (any cloned voice)
    prompt_feat: np.ndarray  # [Tp, 80] float32 prompt mel, aligned with flow_prompt_speech_tokens
    sampling: SamplingOptions
    speed: float
    segment_index: int = 0
    num_segments: int = 1
    voice: str | None = None  # the voice's name: with `prompt_key`, what a decoder's prompt cache keys on
    prompt_key: str | None = None  # a hash of everything the voice puts before the text (None: nothing is cached)
