"""Bi-streamed synthesis (CosyVoice2/3): text pieces in as they are written, audio out as soon as it can be made.

`BistreamStart` is what the encoder side hands over once per utterance (`TextEncoderStage.bistream_start`): the
prompt text ids and the voice (an `EncodedSegment` without text). `BistreamSynthesis` runs one utterance on a
decoder stage: each text piece's ids (`TextEncoderStage.text_piece_tokens`: tokenized as they come, not
normalised, as the official generator input) go to the LM (`engine.llm.bistream.BistreamDecoder`, the official
`inference_bistream`), and its speech tokens through the family's streaming chunks (`DecodeStream.add_fed`).

v1 has no bi-streaming (its LM was not trained on mixed text and speech): it is refused here, and the WebSocket
route speaks v1 sentence by sentence. In a decoder replica an utterance is a request of its loop
(`Scheduler.submit_bistream`): its LM steps one token per loop step beside the batch, its chunks on the lanes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import InvalidInputError
from engine.families.base import ModelFamily
from engine.llm.bistream import BistreamDecoder
from engine.loading.loader import LoadedModel
from engine.runtime.segment import EncodedSegment
from engine.runtime.streaming import DecodeStream


def check_bistream(family: ModelFamily) -> None:
    """InvalidInputError unless the family's LLM bi-streams."""
    if not family.bistream:
        raise InvalidInputError(
            f"{family.name} models have no bi-streaming (text tokens joining the LLM as they come): send the text "
            "sentence by sentence"
        )


@dataclass
class BistreamStart:
    """One bi-streamed utterance before any text: its prompt text ids [P] int64 and its voice (a segment whose
    text fields are empty: the text comes piece by piece)."""

    prompt_text_tokens: np.ndarray
    voice: EncodedSegment


def open_bistream_decoder(model: LoadedModel, start: BistreamStart) -> BistreamDecoder:
    """The LM side of one bi-streamed utterance on `model`'s decoder device (InvalidInputError: not a bi-streaming
    family, or a prompt out of range)."""
    check_bistream(model.config.family)
    voice, device = start.voice, model.decoder_device
    return BistreamDecoder(
        model.llm,
        torch.as_tensor(start.prompt_text_tokens, dtype=torch.long, device=device),
        torch.as_tensor(voice.llm_prompt_speech_tokens, dtype=torch.long, device=device),
        voice.sampling,
    )


def check_text_piece(model: LoadedModel, tokens: object) -> list[int]:
    """A text piece as the decoder takes it: a list of the LM's text ids; else InvalidInputError."""
    vocabulary = model.llm.llm.model.model.embed_tokens.num_embeddings
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocabulary for t in tokens):
        raise InvalidInputError(f"a text piece is a list of text ids in [0, {vocabulary})")
    return tokens


class BistreamSynthesis:
    """One utterance: `push_text` per text piece (the audio made meanwhile), then `finish` (the rest of the audio).

    `decoder` is an `engine.runtime.decoder_stage.SpeechDecoderStage`."""

    def __init__(self, decoder, start: BistreamStart) -> None:
        self.llm = open_bistream_decoder(decoder.model, start)
        self.audio = DecodeStream(decoder, [])
        self.stream = self.audio.add_fed(start.voice)

    def push_text(self, tokens: list[int]) -> list[np.ndarray]:
        """The next piece's text ids -> the audio chunks made with it (none while the LM waits for text)."""
        speech = self.llm.push_text(torch.tensor(tokens, dtype=torch.long))
        self.audio.feed(self.stream, speech, done=False)
        return list(self._chunks())

    def finish(self) -> Iterator[np.ndarray]:
        """No more text: the rest of the audio, chunk by chunk as its tokens come."""
        for token in self.llm.finish():
            self.audio.feed(self.stream, [token], done=False)
            yield from self._chunks()
        self.audio.feed(self.stream, [], done=True)
        yield from self._chunks()

    def _chunks(self) -> Iterator[np.ndarray]:
        while True:
            made = self.audio.emit([self.stream])
            if not made:
                return
            [(_, chunk)] = made
            if isinstance(chunk, BaseException):  # non-finite audio, a fault of this stream, out of memory
                raise chunk
            if len(chunk):
                yield chunk
