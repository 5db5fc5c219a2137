"""Bi-streamed synthesis (CosyVoice2/3): text pieces in as they are written, audio out as soon as it can be made.

`BistreamStart` is what the encoder side hands over once per utterance (`TextEncoderStage.bistream_start`): the
prompt text ids and the voice (an `EncodedSegment` without text). `BistreamSynthesis` runs one utterance on a
decoder stage: each text piece's ids (`TextEncoderStage.text_piece_tokens`: tokenized as they come, not
normalised, as the official generator input) go to the LM (`engine.llm.bistream.BistreamDecoder`, the official
`inference_bistream`), and its speech tokens through the family's streaming chunks (`DecodeStream.add_fed`).

v1 has no bi-streaming (its LM was not trained on mixed text and speech): it is refused here, and the WebSocket
route speaks v1 sentence by sentence. A bi-streamed utterance decodes on its own, outside the scheduler's batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import InvalidInputError
from engine.families.base import ModelFamily
from engine.llm.bistream import BistreamDecoder
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


class BistreamSynthesis:
    """One utterance: `push_text` per text piece (the audio made meanwhile), then `finish` (the rest of the audio).

    `decoder` is an `engine.runtime.decoder_stage.SpeechDecoderStage`."""

    def __init__(self, decoder, start: BistreamStart) -> None:
        model = decoder.model
        check_bistream(model.config.family)
        voice = start.voice
        device = model.decoder_device
        self.llm = BistreamDecoder(
            model.llm,
            torch.as_tensor(start.prompt_text_tokens, dtype=torch.long, device=device),
            torch.as_tensor(voice.llm_prompt_speech_tokens, dtype=torch.long, device=device),
            voice.sampling,
        )
        self.audio = DecodeStream(decoder, [])
        self.stream = self.audio.add_fed(voice)

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
