"""The CosyVoice3 streaming loop (`CosyVoice3Model.tts(stream=True)`) recorded in the v3 kit's `stream` group,
checked piece by piece against what the engine has: the LLM's tokens, the DiT flow over each chunk's token
prefix with the chunk's streaming/finalize flags, and the causal HiFT re-run over the accumulated mel, cut at the
chunk's speech offset. (The chunk loop itself, with its silent-token filter, is not in the engine yet.)

The official HiFT source comes from fixed buffers drawn at model build; the kit records the source of the last
(longest) HiFT call of each stream, and every earlier call's source is its prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from kit_v3 import strictly_loaded, v3_kit_cases, v3_kit_dir, v3_yaml
from test_parity_llm import kit_request

from engine.flow import FlowRequest
from engine.flow_v3 import CausalMaskedDiffWithDiT, DiTFlowConfig
from engine.hift_v3 import F0_LOOKAHEAD, CausalHiFTConfig, CausalHiFTGenerator
from engine.llm_v3 import CosyVoice3LM, CosyVoice3LMConfig

MEL_ATOL = 1e-4  # as the flow parity test (measured within a few 1e-6)
SPEECH_ATOL = 1e-4  # as the HiFT parity test


@pytest.fixture(scope="module")
def kit() -> Path:
    return v3_kit_dir()


@pytest.fixture(scope="module")
def stream_cases(kit: Path) -> list[dict[str, Any]]:
    cases = v3_kit_cases(kit).get("stream")
    if not cases:
        pytest.skip("the kit has no stream group")
    return cases


@pytest.fixture(scope="module")
def flow(kit: Path) -> CausalMaskedDiffWithDiT:
    return strictly_loaded(CausalMaskedDiffWithDiT(DiTFlowConfig.from_yaml(v3_yaml(kit)["flow"])), kit, "flow")


@pytest.fixture(scope="module")
def hift(kit: Path) -> CausalHiFTGenerator:
    return strictly_loaded(CausalHiFTGenerator(CausalHiFTConfig.from_yaml(v3_yaml(kit)["hift"])), kit, "hift")


def chunks(case: dict[str, Any]) -> list[dict[str, Any]]:
    """The case's chunk_<k>_<field> entries as one dict per chunk."""
    prefix = "chunk_{}_"
    return [
        {key.removeprefix(prefix.format(k)): value for key, value in case.items() if key.startswith(prefix.format(k))}
        for k in range(case["num_chunks"])
    ]


def flow_request(case: dict[str, Any], tokens: torch.Tensor) -> FlowRequest:
    return FlowRequest(
        tokens=tokens,
        prompt_tokens=case["flow_prompt_speech_token"][0],
        prompt_feat=case["prompt_speech_feat"][0],
        embedding=case["flow_embedding"][0],
    )


def test_the_kit_streams_in_three_chunks_with_and_without_a_prompt(stream_cases: list[dict[str, Any]]) -> None:
    """What the cases were chosen to show is there: >= 3 chunks, the last one short, with and without a prompt."""
    for prompted in (False, True):
        found = [case for case in stream_cases if (case["flow_prompt_speech_token"].shape[1] > 0) == prompted]
        assert any(case["num_chunks"] >= 3 for case in found), f"no stream case of >= 3 chunks, prompted={prompted}"
    for case in stream_cases:
        *_, last = chunks(case)
        assert last["finalize"] and not last["streaming"], case["name"]
        assert len(last["tokens"]) - last["token_offset"] < case["token_max_hop_len"], case["name"]


def test_llm_greedy_tokens(kit: Path, stream_cases: list[dict[str, Any]]) -> None:
    """Our greedy LLM on the case's inputs yields the official LLM's tokens (the fixed-list case has no LLM run)."""
    llm = strictly_loaded(CosyVoice3LM(CosyVoice3LMConfig.from_yaml(v3_yaml(kit)["llm"], kit / "model")), kit, "llm")
    generated = [case for case in stream_cases if case["sampler"].startswith("greedy")]
    assert generated, "the kit has no stream case driven by the LLM"
    for case in generated:
        request = kit_request(
            llm,
            {
                **case,
                "text_len": torch.tensor([case["text"].shape[1]]),
                "prompt_speech_token": case["llm_prompt_speech_token"],
                "embedding": torch.zeros(0),
            },
        )
        (tokens,) = llm.generate([request])
        assert tokens.tolist() == case["llm_tokens"].tolist(), case["name"]


def test_flow_over_each_chunk_prefix(flow: CausalMaskedDiffWithDiT, stream_cases: list[dict[str, Any]]) -> None:
    """Each chunk's flow call: the whole token prefix, chunk attention unless final, look-ahead held back unless
    final; the last chunk's call is also the whole (non-stream) call."""
    for case in stream_cases:
        for k, chunk in enumerate(chunks(case)):
            (mel,) = flow.inference(
                [flow_request(case, chunk["tokens"])],
                streaming=bool(chunk["streaming"]),
                finalize=bool(chunk["finalize"]),
            )
            torch.testing.assert_close(mel, chunk["flow_mel"][0], atol=MEL_ATOL, rtol=0, msg=f"{case['name']} {k}")
        (whole,) = flow.inference([flow_request(case, case["out_tokens"])])
        torch.testing.assert_close(whole, case["whole_mel"][0], atol=MEL_ATOL, rtol=0, msg=case["name"])


def test_vocoder_input_is_the_accumulated_new_frames(stream_cases: list[dict[str, Any]]) -> None:
    """The HiFT mel of chunk k is every earlier chunk's new frames (flow mel from 2 x token_offset on) in order."""
    for case in stream_cases:
        ratio = case["token_mel_ratio"]
        new_frames = [chunk["flow_mel"][:, :, chunk["token_offset"] * ratio :] for chunk in chunks(case)]
        for k, chunk in enumerate(chunks(case)):
            accumulated = torch.cat(new_frames[: k + 1], dim=2)
            assert accumulated.shape[2] == chunk["hift_frames"], f"{case['name']} chunk {k}"
            assert torch.equal(accumulated, case["hift_mel"][:, :, : chunk["hift_frames"]]), f"{case['name']} {k}"


def test_vocoder_rerun_cut_at_the_speech_offset(hift: CausalHiFTGenerator, stream_cases: list[dict[str, Any]]) -> None:
    """decode() over the accumulated mel (with the official source) from sample speech_offset on is the chunk's
    audio; an intermediate call keeps back the look-ahead frames' samples, the final one ends the stream."""
    hop = hift.config.hop
    for case in stream_cases:
        for k, chunk in enumerate(chunks(case)):
            finalize = bool(chunk["finalize"])
            frames = chunk["hift_frames"] - (0 if finalize else F0_LOOKAHEAD)
            mel, source = case["hift_mel"][:, :, :frames], case["hift_source"][:, :, : frames * hop]
            with torch.inference_mode():
                speech = hift.decode(mel, source, finalize=finalize)
            end = chunk["speech_offset"] + chunk["speech"].shape[1]
            assert not speech[:, end:].any(), f"{case['name']} chunk {k}: samples past the official ones"
            actual = speech[:, chunk["speech_offset"] : end]
            torch.testing.assert_close(actual, chunk["speech"], atol=SPEECH_ATOL, rtol=0, msg=f"{case['name']} {k}")
        torch.testing.assert_close(
            torch.cat([chunk["speech"] for chunk in chunks(case)], dim=1), case["speech"], atol=0, rtol=0
        )


def test_whole_vocoder_call(hift: CausalHiFTGenerator, stream_cases: list[dict[str, Any]]) -> None:
    for case in stream_cases:
        with torch.inference_mode():
            speech = hift.decode(case["whole_mel"], case["whole_source"])
        torch.testing.assert_close(speech, case["whole_speech"], atol=SPEECH_ATOL, rtol=0, msg=case["name"])


def test_inference_sample_counts_follow_the_speech_offsets(
    hift: CausalHiFTGenerator, stream_cases: list[dict[str, Any]]
) -> None:
    """Our inference() (its own source draws) yields as many samples per call as the official re-run."""
    for case in stream_cases:
        for k, chunk in enumerate(chunks(case)):
            mel = case["hift_mel"][0, :, : chunk["hift_frames"]]
            (speech,) = hift.inference([mel], finalize=bool(chunk["finalize"]))
            assert len(speech) == chunk["speech_offset"] + chunk["speech"].shape[1], f"{case['name']} chunk {k}"
