"""Batching, streaming/finalize modes, low precision, limits and config errors of the CosyVoice2 flow."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import CheckpointError, InvalidInputError
from engine.flow.causal import NOISE_FRAMES, CausalFlowConfig, CausalMaskedDiffWithXvec, chunk_attention_mask
from engine.flow.masked_diff import FlowRequest
from engine.loading.yaml_config import ObjectSpec, load_model_yaml
from tests.engine.test_flow import BATCH_ATOL, assert_low_precision_close, max_error, with_node
from tests.parity.test_parity_flow import request_of  # the same case fields in every kit

MODES = [(False, True), (True, True), (True, False)]  # (streaming, finalize)


@pytest.fixture(scope="module")
def flow_yaml(v2_kit: Path) -> ObjectSpec:
    return load_model_yaml(v2_kit / "model" / "cosyvoice2.yaml")["flow"]


@pytest.fixture(scope="module")
def requests(v2_kit_cases: dict[str, list[dict[str, Any]]]) -> list[FlowRequest]:
    """Three mixed lengths: a short prompt-free request and the kit's shortest and longest flow cases."""
    by_length = sorted(v2_kit_cases["flow"], key=lambda case: case["token"].shape[1] + case["prompt_token"].shape[1])
    short, long = request_of(by_length[0]), request_of(by_length[-1])
    generator = torch.Generator().manual_seed(5)
    no_prompt = FlowRequest(
        tokens=torch.randint(0, 96, (13,), generator=generator),
        prompt_tokens=short.prompt_tokens[:0],
        prompt_feat=short.prompt_feat[:0],
        embedding=torch.randn(192, generator=generator),
    )
    return [no_prompt, long, short]


@pytest.mark.parametrize(("streaming", "finalize"), MODES)
def test_batched_requests_equal_each_alone(
    kit_flow_v2: CausalMaskedDiffWithXvec, requests: list[FlowRequest], streaming: bool, finalize: bool
) -> None:
    modes = {"streaming": streaming, "finalize": finalize}
    alone = [kit_flow_v2.inference([r], **modes)[0] for r in requests]
    assert len({a.shape[-1] for a in alone}) == len(requests)
    batched = kit_flow_v2.inference(requests, **modes)
    for index, (feat, reference) in enumerate(zip(batched, alone, strict=True)):
        assert max_error(feat, reference) <= BATCH_ATOL, f"request {index}"
    conditioning = kit_flow_v2.prepare(requests, **modes)
    for row, length in enumerate(conditioning.mel_lengths):
        assert conditioning.mask[row, 0, :length].all() and conditioning.mask[row, 0, length:].sum() == 0


def test_streaming_limits_attention_to_chunks(
    kit_flow_v2: CausalMaskedDiffWithXvec, requests: list[FlowRequest]
) -> None:
    long = requests[1]
    assert len(long.prompt_tokens) + len(long.tokens) > kit_flow_v2.config.encoder_chunk_size
    full, chunked = (kit_flow_v2.inference([long], streaming=s)[0] for s in (False, True))
    assert max_error(full, chunked) > 1e-2
    # a query sees the valid keys of its own and earlier chunks; a padded query also sees itself
    valid = torch.tensor([[True] * 5 + [False, False]])
    mask = chunk_attention_mask(valid, 2)
    assert mask[0, 0].tolist() == [True, True, False, False, False, False, False]
    assert mask[0, 3].tolist() == [True, True, True, True, False, False, False]
    assert mask[0, 6].tolist() == [True, True, True, True, True, False, True]
    assert chunk_attention_mask(valid, 0)[0, 1].tolist() == [True] * 5 + [False, False]


def test_finalize_false_holds_back_the_lookahead_tokens(
    kit_flow_v2: CausalMaskedDiffWithXvec, requests: list[FlowRequest]
) -> None:
    config = kit_flow_v2.config
    for request in requests:
        (feat,) = kit_flow_v2.inference([request], streaming=True, finalize=False)
        encoded = len(request.prompt_tokens) + len(request.tokens) - config.pre_lookahead_len
        assert feat.shape == (config.output_size, config.token_mel_ratio * encoded - request.prompt_feat.shape[0])
        # the held-back tokens are still read, as look-ahead
        changed = request.tokens.clone()
        changed[-1] = (changed[-1] + 1) % config.vocab_size
        (other,) = kit_flow_v2.inference([dataclasses.replace(request, tokens=changed)], streaming=True, finalize=False)
        assert max_error(other, feat) > 1e-3


def test_noise_and_seed_are_ignored(kit_flow_v2: CausalMaskedDiffWithXvec, requests: list[FlowRequest]) -> None:
    request = requests[0]
    plain = kit_flow_v2.inference([request])[0]
    frames = kit_flow_v2.prepare([request]).mel_lengths[0]
    seeded = dataclasses.replace(request, noise=torch.zeros(80, frames), seed=7)
    assert torch.equal(kit_flow_v2.inference([seeded])[0], plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_run_and_stay_close(
    kit_flow_v2: CausalMaskedDiffWithXvec, requests: list[FlowRequest], dtype: torch.dtype
) -> None:
    assert_low_precision_close(kit_flow_v2, requests, dtype, streaming=True, finalize=False)  # the most masked mode


def test_too_long_requests_are_rejected(kit_flow_v2: CausalMaskedDiffWithXvec, requests: list[FlowRequest]) -> None:
    base = requests[2]
    tokens_left = NOISE_FRAMES // kit_flow_v2.config.token_mel_ratio - len(base.prompt_tokens)
    too_long = dataclasses.replace(base, tokens=torch.zeros(tokens_left + 1, dtype=torch.long))
    with pytest.raises(InvalidInputError, match=f"request 1 needs {NOISE_FRAMES + 2} mel frames .* at most 15000"):
        kit_flow_v2.inference([base, too_long])
    assert kit_flow_v2.decoder.start_noise(NOISE_FRAMES).shape == (1, 80, NOISE_FRAMES)
    with pytest.raises(InvalidInputError, match="at most 15000 mel frames"):
        kit_flow_v2.decoder.start_noise(NOISE_FRAMES + 1)


def test_invalid_requests_raise_invalid_input_error(
    kit_flow_v2: CausalMaskedDiffWithXvec, requests: list[FlowRequest]
) -> None:
    base = requests[2]
    with pytest.raises(InvalidInputError, match=r"no mel frames after its 12 prompt frames.*look-ahead only"):
        kit_flow_v2.inference([dataclasses.replace(base, tokens=base.tokens[:3])], finalize=False)
    with pytest.raises(InvalidInputError, match="vocabulary size 96"):
        kit_flow_v2.inference([dataclasses.replace(base, tokens=torch.tensor([96]))])
    with pytest.raises(InvalidInputError, match="both empty or both non-empty"):
        kit_flow_v2.inference([dataclasses.replace(base, prompt_feat=base.prompt_feat[:0])])
    with pytest.raises(InvalidInputError, match="at least one request"):
        kit_flow_v2.prepare([])


def test_from_yaml_reads_the_kit_config(flow_yaml: ObjectSpec) -> None:
    config = CausalFlowConfig.from_yaml(flow_yaml)
    assert (config.input_size, config.output_size, config.vocab_size) == (512, 80, 96)
    assert (config.token_mel_ratio, config.pre_lookahead_len) == (2, 3)
    assert (config.encoder_chunk_size, config.decoder_chunk_size) == (25, 50)
    assert (config.encoder.num_blocks, config.encoder.attention_heads, config.encoder.linear_units) == (1, 4, 32)
    assert config.decoder.inference_cfg_rate == pytest.approx(0.7)
    assert config.decoder.estimator.channels == 32


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("target",), "cosyvoice.flow.flow.MaskedDiffWithXvec", "expected CausalMaskedDiffWithXvec"),
        (("encoder", "target"), "x.ConformerEncoder", "expected UpsampleConformerEncoder"),
        (("encoder", "use_cnn_module"), True, "use_cnn_module"),
        (("encoder", "output_size"), 256, "must be 512"),
        (("encoder", "static_chunk_size"), 0, "positive static_chunk_size"),
        (("pre_lookahead_len",), 2, "pre_lookahead_len must be 3"),
        (("token_mel_ratio",), 3, "token_mel_ratio must be 2"),
        (("decoder", "target"), "x.ConditionalCFM", "expected CausalConditionalCFM"),
        (("decoder", "estimator", "target"), "x.ConditionalDecoder", "expected CausalConditionalDecoder"),
        (("decoder", "estimator", "channels"), [32, 32], "only one level"),
        (("decoder", "estimator", "num_decoding_left_chunks"), 2, "num_decoding_left_chunks"),
        (("decoder", "estimator", "in_channels"), 240, "in/out channels"),
    ],
)
def test_unsupported_config_raises_checkpoint_error(
    flow_yaml: ObjectSpec, path: tuple[str, ...], value: Any, message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        CausalFlowConfig.from_yaml(with_node(flow_yaml, path, value))
