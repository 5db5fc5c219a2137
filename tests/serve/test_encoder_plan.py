"""A streamed request's later sentences: `Encoder.encode_first` gives the ingress a plan of texts without the voice's
arrays, and `Encoder.encode_planned` (on this replica or another) encodes them as one `Encoder.encode` call would
(the `Encoder` deployment's class with the tiny model; no Ray)."""

from __future__ import annotations

import pickle
from dataclasses import fields

import numpy as np
import pytest

from deployments.encoder import Encoder
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.registry import EVERYONE
from serve_app.request_args import LimitsArgs

# Long enough for the splitter to make several segments of it (it joins short sentences).
TEXT = " ".join(f"Sentence {word} goes on for a while, with a few more words than it needs." for word in "abcdefghij")


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder.func_or_class("tiny", False, LimitsArgs().max_input_chars)


def assert_same_segments(got: list[EncodedSegment], expected: list[EncodedSegment]) -> None:
    assert len(got) == len(expected)
    for one, other in zip(got, expected, strict=True):
        for field in fields(EncodedSegment):
            mine, theirs = getattr(one, field.name), getattr(other, field.name)
            if isinstance(theirs, np.ndarray):
                np.testing.assert_array_equal(mine, theirs)
            else:
                assert mine == theirs, field.name


def test_the_later_sentences_travel_without_the_voice_arrays_and_encode_as_one_call_would(encoder: Encoder) -> None:
    request = SynthesisRequest(TEXT, "dummy_female", speed=1.0).validated()  # its seed drawn once for both paths
    first, plan = encoder.encode_first(request, "req-1", EVERYONE)
    assert len(first) == 1 and plan.num_segments > 1
    assert b"numpy" not in pickle.dumps(plan)  # texts and the voice's name go to the ingress, no arrays
    later = encoder.encode_planned(plan, 1, "req-1")
    assert_same_segments(first + later, encoder.encode(request, "req-1", EVERYONE))
