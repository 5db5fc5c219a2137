"""The single-request API: `CosyVoice.synthesize` runs the two serving stages in-process, the text encoder
(`engine.runtime.encoder_stage`) and the speech decoder (`engine.runtime.decoder_stage`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from engine.llm.sampling import SamplingOptions
from engine.loading.loader import LoadedModel, load_model
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.synthesis_request import SynthesisRequest


class CosyVoice:
    """Single-process TTS: `synthesize(text, voice) -> (waveform float32 [N], sample_rate)`."""

    def __init__(self, model: LoadedModel) -> None:
        self.encoder = TextEncoderStage(model)
        self.decoder = SpeechDecoderStage(model)

    @classmethod
    def load(cls, source: str = "tiny", **kwargs) -> CosyVoice:
        """`source`: an official model directory, or `dummy` / `tiny` (see `engine.loading.loader.load_model`)."""
        return cls(load_model(source, **kwargs))

    @property
    def voices(self) -> list[str]:
        return self.encoder.voices

    @property
    def sample_rate(self) -> int:
        return self.decoder.sample_rate

    def synthesize(self, text: str, voice: str, **options) -> tuple[np.ndarray, int]:
        """Synthesise `text` in `voice`; sentences are decoded as one batch and joined in order."""
        sampling_keys = set(SamplingOptions.__dataclass_fields__)
        sampling = SamplingOptions(**{k: v for k, v in options.items() if k in sampling_keys})
        rest = {k: v for k, v in options.items() if k not in sampling_keys}
        request = SynthesisRequest(text=text, voice=voice, sampling=sampling, **rest)
        results = self.decoder.decode_batch(self.encoder.encode(request))
        for result in results:
            if isinstance(result, Exception):
                raise result
        return np.concatenate(results), self.sample_rate

    def bistream(self, pieces: Iterable[str], voice: str, **options) -> Iterator[np.ndarray]:
        """Bi-streaming (CosyVoice2/3): the text comes as `pieces` (an iterator may wait for each); the audio chunks
        as they are made, the first ones while the text is still coming. Options as `synthesize`."""
        sampling_keys = set(SamplingOptions.__dataclass_fields__)
        sampling = SamplingOptions(**{k: v for k, v in options.items() if k in sampling_keys})
        rest = {k: v for k, v in options.items() if k not in sampling_keys}
        start = self.encoder.bistream_start(SynthesisRequest(text="", voice=voice, sampling=sampling, **rest))
        synthesis = self.decoder.open_bistream(start)
        for piece in pieces:
            yield from synthesis.push_text(self.encoder.text_piece_tokens(piece))
        yield from synthesis.finish()
