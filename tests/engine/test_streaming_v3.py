"""CosyVoice3 streaming on the tiny v3 preset (random weights): the v2 chunk schedule with the causal vocoder
re-run, end to end through `DecodeStream`; streams batched together; speed refused; and the bounded vocoder window
against the official full re-run on a long input. Parity with the official loop: test_parity_stream_v3.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import InvalidInputError
from engine.families.chunking import CausalPrefixRerunChunks
from engine.llm.cosyvoice3_lm import ENDOFPROMPT_TOKEN
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import load_model
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.scheduler import Output, Scheduler
from engine.runtime.segment import EncodedSegment
from engine.runtime.streaming import DecodeStream
from engine.vocoder.causal_hift import CausalHiFTGenerator, decode_history_frames
from tests.parity.test_parity_stream_v3 import pin_unvoiced_source, spy_flow

TEXT_TOKENS = 5
TOKENS = 20 * TEXT_TOKENS  # min = max length: hops of 25 and 50 (+3 look-ahead tokens), then the final 25


@pytest.fixture(scope="module")
def decoder() -> SpeechDecoderStage:
    return SpeechDecoderStage(load_model("cosyvoice3-tiny", components=("decoder",)))


def segment(decoder: SpeechDecoderStage, seed: int, speed: float = 1.0) -> EncodedSegment:
    """A request as the v3 prompt convention encodes it (system text, <|endofprompt|>, text), `TOKENS` long."""
    ids = torch.tensor([[11, 12, 13, ENDOFPROMPT_TOKEN, *range(40 + seed, 40 + seed + TEXT_TOKENS)]])
    with torch.inference_mode():
        encoded = decoder.model.llm.encode_text(ids, torch.tensor([ids.shape[1]]))[0]
    rng = np.random.default_rng(seed)
    return EncodedSegment(
        text_encoded=encoded.float().numpy(),
        text_len=TEXT_TOKENS,
        llm_embedding=None,
        flow_embedding=rng.standard_normal(192).astype(np.float32),
        llm_prompt_speech_tokens=np.zeros(0, np.int64),
        flow_prompt_speech_tokens=np.zeros(0, np.int64),
        prompt_feat=np.zeros((0, 80), np.float32),
        # the random LM would stop at once on its other stop ids: a fixed length
        sampling=SamplingOptions(
            seed=seed, min_token_text_ratio=20, max_token_text_ratio=20, mask_all_stop_ids_before_min_len=True
        ),
        speed=speed,
    )


def run(stream: DecodeStream) -> list[list[tuple[int, np.ndarray]]]:
    """-> per segment, its non-empty chunks with the step that brought each."""
    out: list[list[tuple[int, np.ndarray]]] = [[] for _ in stream.streams]
    for step, outputs in enumerate(stream, start=1):
        for index, chunk in enumerate(outputs):
            if chunk is not None and len(chunk):
                out[index].append((step, chunk))
    return out


def test_the_v3_preset_streams_end_to_end(decoder: SpeechDecoderStage, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks at 28 and 78 tokens (one per step), then the rest when generation ends; the flow with chunk attention
    but for the last call; finite 24 kHz audio of the whole utterance's length."""
    assert decoder.model.config.family.streaming is CausalPrefixRerunChunks
    flow_calls = spy_flow(decoder, monkeypatch)
    [chunks] = run(decoder.open_stream([segment(decoder, seed=1)]))
    assert [step for step, _ in chunks] == [28, 78, TOKENS]  # max_len: the last token ends the request
    assert [(tokens, streaming, finalize) for tokens, streaming, finalize, _ in flow_calls] == [
        (28, True, False),
        (78, True, False),
        (TOKENS, False, True),
    ]
    audio = np.concatenate([chunk for _, chunk in chunks])
    assert decoder.sample_rate == 24000 and np.isfinite(audio).all() and np.abs(audio).max() > 0
    hop = decoder.model.config.hift.hop
    # an intermediate chunk keeps its last 8 frames' samples (3 f0 and 4 conv_pre look-ahead frames, 1 iSTFT hop)
    assert [len(chunk) for _, chunk in chunks[:2]] == [(50 - 8) * hop, 100 * hop]
    assert len(audio) == 2 * TOKENS * hop


def test_streams_batched_together_equal_them_alone(
    decoder: SpeechDecoderStage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two streams in one DecodeStream: their chunks share one flow and one vocoder batch, and each equals the
    stream alone (the source pinned, see test_parity_stream_v3's scheduler test)."""
    pin_unvoiced_source(decoder.model.hift, monkeypatch)
    batches: list[int] = []
    continue_streams = decoder.model.hift.continue_streams

    def counting(streams, mels, finalize):
        batches.append(len(streams))
        return continue_streams(streams, mels, finalize)

    monkeypatch.setattr(decoder.model.hift, "continue_streams", counting)
    segments = [segment(decoder, seed=2), segment(decoder, seed=3)]
    together = run(decoder.open_stream(segments))
    assert batches == [2, 2, 2]
    for seg, chunks in zip(segments, together, strict=True):
        [alone] = run(decoder.open_stream([seg]))
        assert [step for step, _ in chunks] == [step for step, _ in alone]
        for (_, chunk), (_, expected) in zip(chunks, alone, strict=True):
            np.testing.assert_allclose(chunk, expected, atol=1e-4, rtol=0)


def test_speed_is_refused_when_streaming_as_officially(decoder: SpeechDecoderStage) -> None:
    stream = DecodeStream(decoder, [])
    with pytest.raises(InvalidInputError, match=r"^CosyVoice3 streams at speed 1.0 only.*got speed 1.5") as error:
        stream.add(segment(decoder, seed=1, speed=1.5))
    assert error.value.http_status == 400 and stream.llm.active == 0 and not stream.streams
    # whole, the speed applies (the official non-stream rule)
    [whole] = decoder.decode_batch([segment(decoder, seed=1, speed=1.5)])
    assert len(whole) == int(2 * TOKENS / 1.5) * decoder.model.config.hift.hop


def test_the_decoder_loop_refuses_such_a_stream_at_submit_and_goes_on(decoder: SpeechDecoderStage) -> None:
    """Refused in `submit`, before it is queued: a refusal inside a step would end every request of the loop."""
    scheduler = Scheduler(decoder, max_live=4)
    outputs: list[Output] = []
    scheduler.submit([segment(decoder, seed=2)], streaming=True, sink=outputs.append)
    with pytest.raises(InvalidInputError, match=r"streams at speed 1\.0 only"):
        scheduler.submit([segment(decoder, seed=1, speed=1.5)], streaming=True, sink=outputs.append)
    while scheduler.has_work:
        scheduler.step()
    assert outputs[-1] is None and all(isinstance(chunk, np.ndarray) for chunk in outputs[:-1])  # one request
    assert sum(map(len, outputs[:-1])) == 2 * TOKENS * decoder.model.config.hift.hop


def test_the_bounded_vocoder_window_gives_the_full_re_run_samples(
    decoder: SpeechDecoderStage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 14 s utterance streamed as officially (50, 100, 200, 200, ... new frames, 6 look-ahead frames, then the
    rest): each chunk from `continue_streams`, which decodes a window of the last frames, equals the official
    re-run (inference() over all frames so far, past the samples already sent), and the window stays bounded."""
    hift: CausalHiFTGenerator = decoder.model.hift
    mel = torch.randn(80, 700, generator=torch.Generator().manual_seed(0)) * 1.5 - 4
    decoded_frames: list[int] = []
    decode = hift.decode

    def recording(mel, source, lengths=None, finalize=True):
        decoded_frames.append(mel.shape[-1])
        return decode(mel, source, lengths, finalize)

    stream, sent, previous, hop, new_frames = hift.start_stream(), 0, 0, hift.config.hop, 50
    ends = []
    while ends[-1:] != [mel.shape[1]]:
        done = previous + new_frames + 6 >= mel.shape[1]
        ends.append(mel.shape[1] if done else previous + new_frames + 6)
        previous, new_frames = ends[-1] - 6, min(200, 2 * new_frames)
    previous = 0
    for end in ends:
        final = end == mel.shape[1]
        (full,) = hift.inference([mel[:, :end]], finalize=final)
        with monkeypatch.context() as patch:
            patch.setattr(hift, "decode", recording)
            (chunk,) = hift.continue_streams([stream], [mel[:, previous:end]], [final])
        assert chunk.shape == full[sent:].shape
        torch.testing.assert_close(chunk, full[sent:], atol=1e-4, rtol=0)
        sent, previous = sent + len(chunk), end
    assert sent == mel.shape[1] * hop and len(ends) >= 5
    history = decode_history_frames(hift.config)
    assert history == 30  # the tiny preset has the released layout
    # each window: the history, the 8 frames held back by the last chunk, and the new frames
    assert decoded_frames[-2] == history + 8 + 200 - 3  # an intermediate chunk decodes all but its 3 f0 look-ahead
    assert max(decoded_frames) <= history + 8 + 200


def test_the_source_of_later_frames_alone_equals_the_whole_call_s(decoder: SpeechDecoderStage) -> None:
    hift: CausalHiFTGenerator = decoder.model.hift
    f0 = torch.rand(1, 900, generator=torch.Generator().manual_seed(1)) * 300
    f0[:, ::7] = 0  # unvoiced frames too
    whole = hift.fixed_source(f0)
    for first_frame in (1, 333, 899):
        assert torch.equal(hift.fixed_source(f0, first_frame), whole[:, :, first_frame * hift.config.hop :])
