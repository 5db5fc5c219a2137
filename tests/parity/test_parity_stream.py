"""End-to-end parity of the streaming path (`engine.runtime.streaming.DecodeStream`) with the official streaming loop
`CosyVoiceModel.tts(stream=True)` (v1: flow cache, mel and speech cross-fades, HiFT cache) and
`CosyVoice2Model.tts(stream=True)` (v2: the chunk loop with its padded first hop and the final chunk), on every
`stream` case of the v1 and v2 kits. The official random draws (v1's CFM start noise, the HiFT source) are
replayed. CosyVoice3's loop (a vocoder re-run instead of the HiFT cache): test_parity_stream_v3.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from engine.families.chunking import OverlappingChunks
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import load_model
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.segment import EncodedSegment
from tests.conftest import kit_group

# The kits' acceptance for a flow mel, and for each chunk's audio (decode of the recorded mel and source): measured
# at most 5.4e-6 and 1.5e-6 against the AMD-recorded kits on an Intel Xeon with AMX, on every kernel path the kit
# tool varies (docs/parity.md). v2's audio had 5e-4 while the vocoder's Snake rounded otherwise (a fused Snake,
# since fixed).
MEL_ATOL = 1e-4
SPEECH_ATOL = 1e-4


@pytest.fixture(scope="module")
def decoder(v1_v2_kit: Path) -> SpeechDecoderStage:
    return SpeechDecoderStage(load_model(v1_v2_kit / "model", components=("decoder",), cpu_packing=False))


@pytest.fixture(scope="module")
def stream_cases(v1_v2_kit: Path) -> list[dict[str, Any]]:
    return kit_group(torch.load(v1_v2_kit / "cases.pt", weights_only=True), "stream")


def segment_of(decoder: SpeechDecoderStage, case: dict[str, Any]) -> EncodedSegment:
    """The case's official call as an encoded segment: greedy, the case's length ratios; zero-shot (the v1/v2 kits
    give the LLM and the flow the same prompt and speaker, the v3 kit names each: `llm_...`, `flow_...`)."""
    text = torch.cat([case["prompt_text"], case["text"]], dim=1).long()
    with torch.inference_mode():
        encoded = decoder.model.llm.encode_text(text, torch.tensor([text.shape[1]]))[0]

    def recorded_as(name: str, v3_name: str) -> np.ndarray:
        return case[v3_name if v3_name in case else name][0].numpy()

    return EncodedSegment(
        text_encoded=encoded.float().numpy(),
        text_len=case["text"].shape[1],
        llm_embedding=recorded_as("embedding", "llm_embedding"),
        flow_embedding=recorded_as("embedding", "flow_embedding"),
        llm_prompt_speech_tokens=recorded_as("prompt_speech_token", "llm_prompt_speech_token").astype(np.int64),
        flow_prompt_speech_tokens=recorded_as("prompt_speech_token", "flow_prompt_speech_token").astype(np.int64),
        prompt_feat=recorded_as("prompt_feat", "prompt_speech_feat"),
        sampling=SamplingOptions(
            greedy=True,
            seed=0,
            min_token_text_ratio=case["min_token_text_ratio"],
            max_token_text_ratio=case["max_token_text_ratio"],
        ),
        speed=1.0,
    )


def recorded(case: dict[str, Any], field: str) -> Iterator[Tensor]:
    return iter([case[f"chunk_{k}_{field}"] for k in range(case["num_chunks"]) if f"chunk_{k}_{field}" in case])


def replay_official_draws(
    decoder: SpeechDecoderStage, case: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> list[Tensor]:
    """Feed the official noise and sources to the stream, in chunk order; -> the mels the vocoder gets."""
    hift, hop = decoder.model.hift, decoder.model.config.hift.hop
    noises, sources = recorded(case, "noise"), recorded(case, "source")
    mels: list[Tensor] = []

    def start_noise(_stream: Any, channels: int, frames: int) -> Tensor:
        noise = next(noises)
        assert noise.shape == (channels, frames), f"noise {tuple(noise.shape)} for [{channels}, {frames}]"
        return noise.clone()

    def make_source(f0: Tensor, _generator: Any = None) -> Tensor:
        source = next(sources)
        assert source.shape[-1] == f0.shape[-1] * hop, f"source of {source.shape[-1]} samples for {f0.shape[-1]} frames"
        return source.clone()

    decode = hift.decode

    def recording_decode(mel: Tensor, source: Tensor, lengths: Tensor | None = None) -> Tensor:
        mels.append(mel[0].clone())
        return decode(mel, source, lengths)

    monkeypatch.setattr(OverlappingChunks, "start_noise", staticmethod(start_noise))
    monkeypatch.setattr(hift, "make_source", make_source)
    monkeypatch.setattr(hift, "decode", recording_decode)
    return mels


def test_stream_tokens_match_official(decoder: SpeechDecoderStage, stream_cases: list[dict[str, Any]]) -> None:
    for case in stream_cases:
        [tokens] = decoder.generate_tokens([segment_of(decoder, case)])
        assert torch.equal(tokens, case["out_tokens"]), case["name"]


def test_stream_chunks_match_official(
    decoder: SpeechDecoderStage, stream_cases: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for case in stream_cases:
        name = case["name"]
        with monkeypatch.context() as patch:
            mels = replay_official_draws(decoder, case, patch)
            chunks = [out[0] for out in decoder.open_stream([segment_of(decoder, case)]) if out[0] is not None]
        chunks = [chunk for chunk in chunks if len(chunk)]
        assert len(chunks) == len(mels) == case["num_chunks"], name
        assert [case[f"chunk_{k}_finalize"] for k in range(case["num_chunks"])][-1] == 1, name
        for k, (chunk, mel) in enumerate(zip(chunks, mels, strict=True)):
            expected_mel = case[f"chunk_{k}_mel"][0]
            assert mel.shape == expected_mel.shape, f"{name} chunk {k} mel {tuple(mel.shape)}"
            torch.testing.assert_close(mel.float(), expected_mel, atol=MEL_ATOL, rtol=0, msg=f"{name} chunk {k} mel")
            expected = case[f"chunk_{k}_speech"][0].numpy()
            assert chunk.shape == expected.shape, f"{name} chunk {k}: {chunk.shape} samples, official {expected.shape}"
            error = float(np.abs(chunk - expected).max())
            assert error <= SPEECH_ATOL, f"{name} chunk {k} speech: max abs error {error:.3g}"
