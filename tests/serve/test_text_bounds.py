"""A text is bounded by its tokens before the encoder works on it: token-heavy text (4096 characters, 8192 tokens of
emoji) is refused with 413 at once and in little memory, a sentence too long for the text encoder's attention is
refused before it is encoded, and what is accepted encodes in bounded memory (`TextEncoderStage`, through the
`Encoder` deployment's class with the app's default limits; no Ray). Through a real Serve app:
tests/serve/test_fuzz_requests.py."""

from __future__ import annotations

import numpy as np
import pytest

from deployments.encoder import Encoder
from engine.errors import TextTooLongError
from engine.runtime import encoder_stage
from engine.runtime.encoder_stage import MAX_SENTENCE_TOKENS, encoder_batches
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.registry import EVERYONE
from serve_app.request_args import LimitsArgs
from tests.serve.conftest import bounded_in_time_and_memory

LIMITS = LimitsArgs()  # the defaults: 4096 characters, 6144 tokens
EMOJI_TEXT = "a" + "\U0001f600" * (LIMITS.max_input_chars - 1)  # 8192 tokens: before the bound, +4.7 GB and 34 s
REFUSAL_S = 1.0  # the bound on refusing an over-long text; the count takes about a millisecond
MAX_GROWTH_BYTES = 200 << 20


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder.func_or_class("tiny", False, LIMITS.max_input_chars, max_text_tokens=LIMITS.max_input_tokens)


def request(text: str, **options: object) -> SynthesisRequest:
    return SynthesisRequest(text, "dummy_female", **options)


def test_emoji_text_is_refused_with_413_at_once_in_little_memory(encoder: Encoder) -> None:
    for call in (encoder.encode, encoder.encode_first):
        refusal = pytest.raises(TextTooLongError, match="8191 tokens long; the limit is 6144")
        with bounded_in_time_and_memory(REFUSAL_S, MAX_GROWTH_BYTES), refusal as refused:
            call(request(EMOJI_TEXT), "req-1", EVERYONE)
        assert refused.value.http_status == 413


def test_a_sentence_too_long_for_the_encoder_is_refused_before_it_is_encoded(encoder: Encoder) -> None:
    run_on = " ".join(["a"] * (MAX_SENTENCE_TOKENS + 10))  # under the text's bound, one sentence without marks
    refusal = pytest.raises(TextTooLongError, match=f"a sentence with its prompt is .* limit is {MAX_SENTENCE_TOKENS}")
    # normalised and split first: more than the count, still no encoding
    with bounded_in_time_and_memory(REFUSAL_S * 5, MAX_GROWTH_BYTES), refusal:
        encoder.encode(request(run_on), "req-2", EVERYONE)
    instruction = "Speak " + "a " * MAX_SENTENCE_TOKENS + "slowly."
    with pytest.raises(TextTooLongError, match="a sentence with its prompt"):
        encoder.stage.plan(request("Hello there.", instruct_text=instruction))


def test_the_longest_sentence_beside_many_short_ones_encodes_in_bounded_memory(encoder: Encoder) -> None:
    """Padded into one batch with the longest, 50 short sentences would take 50 times its attention's memory."""
    longest = " ".join(["a"] * (MAX_SENTENCE_TOKENS - 20)) + "."
    text = longest + " Short one here." * 50
    with bounded_in_time_and_memory(120.0, MAX_GROWTH_BYTES):
        segments = encoder.encode(request(text), "req-3", EVERYONE)
    assert len(segments) > 2 and max(segment.text_len for segment in segments) > MAX_SENTENCE_TOKENS - 30


def test_sentences_encode_alike_in_any_batches(encoder: Encoder, monkeypatch: pytest.MonkeyPatch) -> None:
    assert encoder_batches([80] * 200, 1024**2) == [slice(0, 163), slice(163, 200)]
    assert encoder_batches([80, 80, 1024, 80], 1024**2) == [slice(0, 2), slice(2, 3), slice(3, 4)]
    assert encoder_batches([5000], 1024**2) == [slice(0, 1)] and encoder_batches([], 1) == []
    plan = encoder.stage.plan(request("This is one of the many short sentences of this text. " * 20))
    together = encoder.stage.encode_planned(plan)
    monkeypatch.setattr(encoder_stage, "ENCODER_BATCH_TOKEN_PAIRS", 1)  # every sentence in a batch of its own
    alone = encoder.stage.encode_planned(plan)
    assert len(together) == len(alone) > 1
    for one, other in zip(together, alone, strict=True):
        np.testing.assert_allclose(one.text_encoded, other.text_encoded, atol=1e-5)
