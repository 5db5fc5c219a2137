"""Bi-streamed synthesis in the engine (engine.runtime.bistream, `CosyVoice.bistream`) on the tiny presets: audio
before the text is complete, the official prompt layout, and v1's refusal. Token parity with the official loop:
tests/parity/test_parity_bistream.py."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from engine.errors import InvalidInputError
from engine.llm.bistream import BistreamDecoder, step_together
from engine.llm.sampling import SamplingOptions
from engine.runtime.pipeline import CosyVoice
from engine.runtime.scheduler import Scheduler
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.cloning import VoicePrompt
from tests.engine.conftest import Collected, step_until

PIECES = ["Hello there, ", "this is a ", "streaming test ", "of text that ", "comes in ", "pieces."]
SHORT = {"seed": 7, "max_token_text_ratio": 3.0}


@pytest.fixture(scope="module")
def tts() -> CosyVoice:
    return CosyVoice.load("cosyvoice3-tiny")


def test_audio_starts_before_the_text_ends(tts: CosyVoice) -> None:
    taken = []

    def pieces() -> Iterator[str]:
        for piece in PIECES:
            taken.append(piece)
            yield piece

    chunks = tts.bistream(pieces(), tts.voices[0], **SHORT)
    first = next(chunks)
    assert len(first) and len(taken) < len(PIECES)  # spoken while text was still to come
    rest = list(chunks)
    audio = np.concatenate([first, *rest])
    assert np.isfinite(audio).all() and len(audio) > tts.sample_rate // 10
    again = np.concatenate(list(tts.bistream(iter(PIECES), tts.voices[0], **SHORT)))
    np.testing.assert_array_equal(audio, again)  # a seed repeats the utterance


def test_the_lm_gets_the_prompt_and_the_pieces_ids(tts: CosyVoice) -> None:
    """A cloned voice: the prompt text (system prompt, <|endofprompt|>, transcript) and the prompt speech go to the
    LM, and each piece's ids as tokenized alone: the synthesis decodes what BistreamDecoder decodes on them."""
    rng = np.random.default_rng(0)
    prompt = VoicePrompt(
        transcript="A short prompt.",
        embedding=rng.standard_normal(192).astype(np.float32),
        speech_tokens=rng.integers(0, 96, 20).astype(np.int64),
        speech_feat=rng.standard_normal((40, 80)).astype(np.float32),
        sample_rate=24000,
        family="CosyVoice3",
    )
    request = SynthesisRequest(text="", voice="cloned", sampling=SamplingOptions(**SHORT))
    start = tts.encoder.bistream_start(request, prompt)
    frontend = tts.encoder.model.frontend
    assert start.prompt_text_tokens.tolist() == frontend.tokenize(
        "You are a helpful assistant.<|endofprompt|>" + frontend.normalize("A short prompt.")
    )
    synthesis = tts.decoder.open_bistream(start)
    alone = BistreamDecoder(
        tts.decoder.model.llm,
        torch.as_tensor(start.prompt_text_tokens),
        torch.as_tensor(prompt.speech_tokens),
        start.voice.sampling,
    )
    for piece in PIECES:
        ids = tts.encoder.text_piece_tokens(piece)
        synthesis.push_text(ids)
        alone.push_text(torch.tensor(ids))
    audio = list(synthesis.finish())
    assert list(alone.finish()) and audio
    assert synthesis.llm.tokens == alone.tokens


def test_v1_has_no_bistreaming() -> None:
    tts = CosyVoice.load("tiny")
    with pytest.raises(InvalidInputError, match="sentence by sentence"):
        next(tts.bistream(iter(PIECES), tts.voices[0]))


def _loop_bistream(tts: CosyVoice, loop: Scheduler, pieces: list[list[int] | None]) -> Collected:
    start = tts.encoder.bistream_start(
        SynthesisRequest(text="", voice=tts.voices[0], sampling=SamplingOptions(**SHORT))
    )
    sink = Collected()
    ticket = loop.submit_bistream(start, sink)
    for piece in pieces:
        loop.push_text(ticket, piece)
    return sink


def test_a_bistream_in_the_decoder_loop_speaks_as_alone_beside_other_requests(tts: CosyVoice) -> None:
    """In a replica's loop an utterance is one more request: its LM steps beside the batch, its chunks on the lanes,
    and its audio is what the utterance makes alone, piece for piece."""
    ids = [tts.encoder.text_piece_tokens(piece) for piece in PIECES]
    alone = tts.decoder.open_bistream(
        tts.encoder.bistream_start(SynthesisRequest(text="", voice=tts.voices[0], sampling=SamplingOptions(**SHORT)))
    )
    expected = [chunk for piece in ids for chunk in alone.push_text(piece)] + list(alone.finish())
    loop = Scheduler(tts.decoder, max_live=4)
    [segment] = tts.encoder.encode(
        SynthesisRequest("A whole request beside it.", tts.voices[0], sampling=SamplingOptions(**SHORT))
    )
    whole = Collected()
    loop.submit([segment], streaming=False, sink=whole)
    sink = _loop_bistream(tts, loop, [*ids, None])
    step_until(loop, lambda: sink.ended and whole.ended)
    np.testing.assert_allclose(np.concatenate(sink.chunks), np.concatenate(expected), atol=1e-5)
    assert whole.chunks and loop.live == 0 and loop.streams.streams == []


def test_a_bistream_in_the_loop_is_cancelled_or_refused_alone(tts: CosyVoice) -> None:
    loop = Scheduler(tts.decoder, max_live=4)
    ids = tts.encoder.text_piece_tokens(PIECES[0])
    left = _loop_bistream(tts, loop, [ids, ids])
    step_until(loop, lambda: loop.live == 1)
    loop.cancel(loop.requests.live[0].request)
    step_until(loop, lambda: left.ended)
    assert loop.live == 0 and loop.stats.cancelled == 1 and loop.streams.streams == []
    ticket = loop.submit_bistream(
        tts.encoder.bistream_start(SynthesisRequest(text="", voice=tts.voices[0])), Collected()
    )
    with pytest.raises(InvalidInputError, match="text ids"):
        loop.push_text(ticket, [10**9])
    with pytest.raises(InvalidInputError, match="no bi-streaming"):
        v1 = CosyVoice.load("tiny")
        Scheduler(v1.decoder, max_live=1).submit_bistream(
            tts.encoder.bistream_start(SynthesisRequest(text="", voice=tts.voices[0])), Collected()
        )


def test_text_streams_decode_side_by_side_within_a_small_budget(tts: CosyVoice) -> None:
    """A bi-stream counts as the sentence a replica is planned for, not as long as the 600 s audio ceiling allows:
    counted so, one filled a CPU replica's budget and text streams ran one after the other."""
    loop = Scheduler(tts.decoder, max_live=4, max_audio_s=600.0, memory_budget_bytes=2 * 2**30)
    ids = tts.encoder.text_piece_tokens(PIECES[0])
    sinks = [_loop_bistream(tts, loop, [ids, None]) for _ in range(3)]
    loop.step()
    assert loop.live == 3
    step_until(loop, lambda: all(sink.ended for sink in sinks))
    assert all(sink.chunks for sink in sinks)
    assert max(loop.stats.bistream_batch_size_counts) == 3  # their LM steps ran as one batch


def _decoder(tts: CosyVoice, seed: int) -> BistreamDecoder:
    start = tts.encoder.bistream_start(
        SynthesisRequest(text="", voice=tts.voices[0], sampling=SamplingOptions(seed=seed, max_token_text_ratio=3.0))
    )
    return BistreamDecoder(tts.decoder.model.llm, torch.as_tensor(start.prompt_text_tokens), None, start.voice.sampling)


def _decode_together(decoders: list[BistreamDecoder], pieces: list[list[int]]) -> list[list[int]]:
    """Each decoder takes its pieces (decoder i starts i pieces late, so their caches differ in length) and ends its
    text; every step steps all the decoders that decode, together -> each one's speech tokens."""
    spoken: list[list[int]] = [[] for _ in decoders]
    queues = [[None] * i + [torch.tensor(p) for p in pieces] + ["end"] for i in range(len(decoders))]
    while any(d.decoding or queue for d, queue in zip(decoders, queues, strict=True)):
        for decoder, queue in zip(decoders, queues, strict=True):
            while not decoder.decoding and not decoder.finished and queue:
                piece = queue.pop(0)
                if piece == "end":
                    decoder.end_text()
                elif piece is not None:
                    decoder.add_text(piece)
                    break
        decoding = [i for i, d in enumerate(decoders) if d.decoding]
        outcomes = step_together([decoders[i] for i in decoding])
        for i, outcome in zip(decoding, outcomes, strict=True):
            assert not isinstance(outcome, Exception)
            if outcome is not None:
                spoken[i].append(outcome)
            if not decoders[i].decoding:  # waiting for text, it holds its own row, not the batch's buffers
                keys = [k for k in decoders[i].cache.keys if k is not None]
                assert all(k.untyped_storage().nbytes() == k.numel() * k.element_size() for k in keys)
    return spoken


def test_bistreams_stepped_together_speak_as_each_alone(tts: CosyVoice) -> None:
    """Their LM forwards in one batch (left-padded, caches of different lengths joined and split again) give each
    utterance the tokens it decodes alone."""
    pieces = [tts.encoder.text_piece_tokens(piece) for piece in PIECES]
    alone = []
    for seed in (1, 2, 3):
        decoder = _decoder(tts, seed)
        alone.append([token for piece in pieces for token in decoder.push_text(torch.tensor(piece))])
        alone[-1] += list(decoder.finish())
    together = _decode_together([_decoder(tts, seed) for seed in (1, 2, 3)], pieces)
    assert together == alone and all(alone)


def test_a_bistream_whose_step_fails_ends_alone(tts: CosyVoice) -> None:
    """A forward that raises for one utterance's state is that utterance's failure: the batch runs again one
    decoder at a time, and the other decodes on as it would alone."""
    text = torch.tensor([token for piece in PIECES for token in tts.encoder.text_piece_tokens(piece)])
    healthy, broken, alone = _decoder(tts, 1), _decoder(tts, 2), _decoder(tts, 1)
    for decoder in (healthy, broken, alone):
        decoder.add_text(text)
        decoder.step()  # the prefill, alone
        assert decoder.decoding
    broken.input = broken.input[:, :-1]  # a width the LM cannot take
    healthy_token, failure = step_together([healthy, broken])
    assert healthy_token == alone.step() and healthy_token is not None
    assert isinstance(failure, RuntimeError)
