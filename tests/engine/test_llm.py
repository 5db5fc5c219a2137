"""Batching, continuous batching, precision and sampling behaviour of the LLM and its encoders."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engine.errors import CheckpointError, InvalidInputError
from engine.llm.generation import GenerationRequest, TokenEvent, TokenGenerator
from engine.llm.sampling import SamplingOptions, make_generator, nucleus_sample, sample_token
from engine.llm.transformer_lm import LLMConfig, TransformerLM
from engine.loading.loader import load_module
from engine.loading.yaml_config import load_model_yaml
from engine.nn.conformer import EncoderConfig, RelPositionEncoder
from tests.conftest import KIT_YAMLS, kit_model_version
from tests.parity.test_parity_llm import case_text, kit_request, run_alone

BATCH_ATOL = 1e-4


@pytest.fixture(scope="module")
def llm_cases(kit_cases: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    cases = kit_cases["llm"]
    assert len(cases) >= 2, "batching tests need at least two llm cases"
    return cases


def collect(generator: TokenGenerator, events: dict[int, list[TokenEvent]]) -> None:
    """Step the generator until it is idle, appending each request's events."""
    while generator.active:
        for event in generator.step():
            events[event.request_id].append(event)


def assert_same_decoding(got: list[TokenEvent], expected: list[TokenEvent], name: str) -> None:
    assert [e.token for e in got] == [e.token for e in expected], name
    assert [e.finish_reason for e in got] == [e.finish_reason for e in expected], name
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=BATCH_ATOL, rtol=0, msg=f"{name} step {step}")


def test_encode_text_padded_batch_equals_alone(kit_llm: TransformerLM, llm_cases: list[dict[str, Any]]) -> None:
    texts = [case_text(case)[0] for case in llm_cases]
    assert len({len(t) for t in texts}) > 1, "the kit's texts should have mixed lengths"
    lengths = torch.tensor([len(t) for t in texts])
    batch = torch.nn.utils.rnn.pad_sequence(texts, batch_first=True)
    with torch.inference_mode():
        batched = kit_llm.encode_text(batch, lengths)
        for row, text in enumerate(texts):
            alone = kit_llm.encode_text(text[None], lengths[row : row + 1])[0]
            torch.testing.assert_close(batched[row, : len(text)], alone, atol=BATCH_ATOL, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_encoder_padding_and_incremental_decoding(causal: bool) -> None:
    torch.manual_seed(0)
    cfg = EncoderConfig(16, 16, 2, 32, 2, "linear_legacy", "relu", causal=causal, block="transformer")
    encoder = RelPositionEncoder(cfg).eval()
    lengths = torch.tensor([9, 4, 1])
    x = torch.randn(3, 9, 16)
    with torch.inference_mode():
        batched = encoder(x, lengths)
        for row, length in enumerate(lengths.tolist()):
            alone = encoder(x[row : row + 1, :length], lengths[row : row + 1])
            torch.testing.assert_close(batched[row, :length], alone[0], atol=BATCH_ATOL, rtol=0)
        if not causal:
            with pytest.raises(ValueError):
                encoder.forward_incremental(x, torch.ones(3, 9, dtype=torch.bool), encoder.new_cache(3))
            return
        # prefill 5 + one position at a time, beyond the first positional table (256) so that it grows
        sequence = torch.randn(1, 300, 16)
        full = encoder(sequence, torch.tensor([300]))
        cache = encoder.new_cache(1)
        steps = [encoder.forward_incremental(sequence[:, :5], torch.ones(1, 5, dtype=torch.bool), cache)]
        for t in range(5, 300):
            steps.append(encoder.forward_incremental(sequence[:, t : t + 1], torch.ones(1, 1, dtype=torch.bool), cache))
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=BATCH_ATOL, rtol=0)


# ---- every family's LLM on its kit (v1 and CosyVoice2; CosyVoice3's: test_parity_llm_v3.py) -----------------


@pytest.fixture(scope="module")
def kit(v1_v2_kit: Path) -> Path:
    return v1_v2_kit


@pytest.fixture(scope="module")
def llm(kit: Path) -> nn.Module:
    """The kit's LLM, of its family's class, strictly loaded through the loader."""
    return load_module(kit / "model", "llm")


@pytest.fixture(scope="module")
def kit_llm_cases(kit: Path) -> list[dict[str, Any]]:
    cases = torch.load(kit / "cases.pt", weights_only=True)["llm"]
    assert len(cases) >= 2, "batching tests need at least two llm cases"
    return cases


def test_batched_generation_equals_alone(llm: nn.Module, kit_llm_cases: list[dict[str, Any]]) -> None:
    requests = [kit_request(llm, case) for case in kit_llm_cases]
    assert len({len(llm.lm_input(r)) for r in requests}) > 1, "the kit's prefills should have mixed lengths"
    generator = TokenGenerator(llm)
    ids = [generator.add(r) for r in requests]
    assert generator.active == len(requests) and generator.batch_size == 0
    events: dict[int, list[TokenEvent]] = {i: [] for i in ids}
    collect(generator, events)
    assert generator.batch_size == 0
    for case, request_id, request in zip(kit_llm_cases, ids, requests, strict=True):
        assert_same_decoding(events[request_id], run_alone(llm, request), case["name"])
    assert [t.tolist() for t in llm.generate(requests)] == [c["out_tokens"].tolist() for c in kit_llm_cases]


@pytest.mark.parametrize("join_after", [1, 7])
def test_requests_joining_mid_way(llm: nn.Module, kit_llm_cases: list[dict[str, Any]], join_after: int) -> None:
    """The first case runs alone for a few steps, then the others join (their prefills may be longer or shorter)."""
    requests = [kit_request(llm, case) for case in kit_llm_cases]
    generator = TokenGenerator(llm)
    first = generator.add(requests[0])
    events: dict[int, list[TokenEvent]] = {first: []}
    for _ in range(join_after):
        for event in generator.step():
            events[event.request_id].append(event)
    ids = [first] + [generator.add(r) for r in requests[1:]]
    events.update({i: [] for i in ids[1:]})
    collect(generator, events)
    for case, request_id, request in zip(kit_llm_cases, ids, requests, strict=True):
        assert_same_decoding(events[request_id], run_alone(llm, request), case["name"])


def test_cancel_frees_the_slot(llm: nn.Module, kit_llm_cases: list[dict[str, Any]]) -> None:
    requests = [kit_request(llm, case) for case in kit_llm_cases]
    generator = TokenGenerator(llm)
    ids = [generator.add(r) for r in requests]
    events: dict[int, list[TokenEvent]] = {i: [] for i in ids}
    for event in generator.step():
        events[event.request_id].append(event)
    running = generator.batch_size
    assert generator.cancel(ids[0])
    assert not generator.cancel(ids[0])
    assert generator.batch_size == running - 1 and generator.active == len(ids) - 1
    pending = generator.add(requests[0])
    assert generator.cancel(pending) and generator.active == len(ids) - 1  # a pending request can leave too
    collect(generator, events)
    assert len(events[ids[0]]) == 1 and pending not in events
    for case, request_id, request in list(zip(kit_llm_cases, ids, requests, strict=True))[1:]:
        assert_same_decoding(events[request_id], run_alone(llm, request), case["name"])
    assert generator.step() == []


@pytest.mark.parametrize("keep_cache", [True, False], ids=["kv-kept", "recomputed"])
def test_requests_paused_together_resume_with_the_decoding_they_have_unpaused(
    llm: nn.Module, kit_llm_cases: list[dict[str, Any]], keep_cache: bool
) -> None:
    """Every running request but the first and one not yet prefilled leave the batch in one `pause` while the first
    steps on, then rejoin in one `resume`: each decodes as it does alone."""
    requests = [kit_request(llm, case) for case in kit_llm_cases]
    generator = TokenGenerator(llm)
    ids = [generator.add(r) for r in requests]
    events: dict[int, list[TokenEvent]] = {i: [] for i in ids}
    for _ in range(3):
        for event in generator.step():
            events[event.request_id].append(event)
    late = generator.add(requests[0])
    events[late] = []
    paused = [*ids[1:], late]
    generator.pause(paused, keep_cache)
    assert generator.paused == len(paused) and generator.batch_size == 1 and generator.active == 1
    for _ in range(4):
        for event in generator.step():
            assert event.request_id == ids[0]
            events[event.request_id].append(event)
    generator.resume(paused)
    assert generator.paused == 0 and generator.active == len(paused) + 1
    collect(generator, events)
    for request_id, request in zip([*ids, late], [*requests, requests[0]], strict=True):
        assert_same_decoding(events[request_id], run_alone(llm, request), f"request {request_id}")
    with pytest.raises(KeyError, match="not active"):
        generator.pause([ids[0]], keep_cache)
    with pytest.raises(KeyError, match="not paused"):
        generator.resume([ids[0]])


def test_sampled_request_is_reproducible_in_any_batch(llm: nn.Module, kit_llm_cases: list[dict[str, Any]]) -> None:
    options = SamplingOptions(seed=1234, max_token_text_ratio=6.0)
    request = kit_request(llm, kit_llm_cases[0], options)
    alone = llm.generate([request])[0]
    others = [kit_request(llm, case, replace(options, seed=i)) for i, case in enumerate(kit_llm_cases[1:])]
    in_batch = llm.generate([*others, request])[-1]
    assert torch.equal(alone, in_batch) and len(alone) > 0
    assert int(alone.max()) < llm.eos
    different_seed = llm.generate([replace(request, options=replace(options, seed=4321))])[0]
    assert not torch.equal(alone, different_seed)


def test_invalid_requests_are_rejected(llm: nn.Module, kit_llm_cases: list[dict[str, Any]]) -> None:
    request = kit_request(llm, kit_llm_cases[0])
    generator = TokenGenerator(llm)
    bad = [
        replace(request, text_len=0),
        replace(request, text_len=len(request.text_encoded) + 1),
        replace(request, text_encoded=request.text_encoded[:, :-1]),
        replace(request, prompt_speech_tokens=torch.tensor([llm.eos])),
        replace(request, prompt_speech_tokens=torch.tensor([-1])),
        replace(request, options=SamplingOptions(min_token_text_ratio=0.0, max_token_text_ratio=0.1)),
    ]
    if isinstance(llm, TransformerLM):  # only v1 takes the speaker embedding (CosyVoice2 ignores any)
        bad.append(replace(request, embedding=torch.ones(3)))
    for candidate in bad:
        with pytest.raises(InvalidInputError):
            generator.add(candidate)
    assert generator.active == 0


def test_requests_without_options_use_the_yaml_sampler(kit: Path, llm: nn.Module) -> None:
    sampler = load_model_yaml(kit / "model" / KIT_YAMLS[kit_model_version(kit)])["llm"]["sampling"]
    for key in ("top_p", "top_k", "win_size", "tau_r"):
        assert getattr(llm.cfg.sampling, key) == sampler[key]
    encoded = torch.zeros(3, llm.cfg.llm_input_size)
    tokens = llm.generate([GenerationRequest(encoded, text_len=1)])[0]
    assert 1 <= len(tokens) <= int(llm.cfg.sampling.max_token_text_ratio)
    assert int(tokens.max()) < llm.eos


# ---- v1 ----------------------------------------------------------------------------------------------------------


def test_text_outside_the_vocabulary_is_rejected(kit_llm: TransformerLM) -> None:
    with pytest.raises(InvalidInputError):
        kit_llm.encode_text(torch.tensor([[kit_llm.cfg.text_token_size]]), torch.tensor([1]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_model_runs_and_stays_close(
    kit_llm: TransformerLM, llm_cases: list[dict[str, Any]], dtype: torch.dtype
) -> None:
    reference = kit_llm
    low = copy.deepcopy(kit_llm).to(dtype)
    assert low.llm.encoders[0].self_attn.linear_q.weight.dtype == dtype
    for case in llm_cases:
        text = case_text(case)
        with torch.inference_mode():
            encoded = low.encode_text(text, torch.tensor([text.shape[1]]))
        assert encoded.dtype == dtype and torch.isfinite(encoded).all()
        torch.testing.assert_close(encoded.float(), case["text_encoder_out"], atol=0.05, rtol=0)
        # same (fp32-encoded) request into both decoders: first-step log-probs agree loosely
        request = replace(
            kit_request(reference, case),
            options=SamplingOptions(greedy=True, min_token_text_ratio=0.0, max_token_text_ratio=1.0),
        )
        steps = [TokenGenerator(model) for model in (reference, low)]
        for generator in steps:
            generator.add(request)
        first, second = (generator.step()[0].logprobs for generator in steps)
        assert torch.isfinite(second).all()
        scale = first.abs().max()
        torch.testing.assert_close(second, first, atol=0.02 * float(scale), rtol=0)


# ---- sampler semantics -------------------------------------------------------------------------------------------


def log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def draws(scores: torch.Tensor, options: SamplingOptions, history: list[int], n: int = 400, seed: int = 0) -> list[int]:
    generator = make_generator(seed)
    return [sample_token(scores, history, options, generator) for _ in range(n)]


def test_seeded_sampling_is_deterministic() -> None:
    scores = torch.log_softmax(torch.randn(64, generator=torch.Generator().manual_seed(1)), dim=0)
    options = SamplingOptions(top_p=1.0, top_k=64)
    assert draws(scores, options, [], seed=7) == draws(scores, options, [], seed=7)
    assert draws(scores, options, [], seed=7) != draws(scores, options, [], seed=8)


def test_top_k_and_top_p_limit_the_candidates() -> None:
    scores = torch.log_softmax(torch.linspace(1.0, 0.0, 32), dim=0)  # nearly flat, token 0 most likely
    assert set(draws(scores, SamplingOptions(top_p=1.0, top_k=3, win_size=1, tau_r=1.0), [])) == {0, 1, 2}
    peaked = log_probs([0.5, 0.3, 0.15, 0.05])
    # mass before token 1 is 0.5 < 0.6 (kept), before token 2 it is 0.8 (stop)
    assert set(draws(peaked, SamplingOptions(top_p=0.6, top_k=25, win_size=1, tau_r=1.0), [])) == {0, 1}
    probs = torch.tensor([0.5, 0.25, 0.25])  # exact in fp32: the mass before token 1 equals top_p, which stops
    assert {nucleus_sample(probs, 0.5, 25, make_generator(s)) for s in range(50)} == {0}
    assert {nucleus_sample(probs, 0.75, 25, make_generator(s)) for s in range(50)} == {0, 1}


def official_nucleus_sample(probs: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator) -> int:
    """The official sampler's nucleus draw: a stable sort of the whole vocabulary, then the kept prefix."""
    sorted_probs, sorted_ids = probs.sort(descending=True, stable=True)
    kept_probs, kept_ids, mass = [], [], 0.0
    for prob, token in zip(sorted_probs.tolist(), sorted_ids.tolist(), strict=True):
        if mass < top_p and len(kept_probs) < top_k:
            mass += prob
            kept_probs.append(prob)
            kept_ids.append(token)
        else:
            break
    choice = torch.multinomial(torch.tensor(kept_probs), 1, replacement=True, generator=generator)
    return kept_ids[int(choice)]


@pytest.mark.parametrize("top_k", [1, 3, 25, 200, 10_000])
def test_the_nucleus_draw_matches_a_whole_vocabulary_sort_with_ties_at_the_kth_place(top_k: int) -> None:
    # Probabilities on a coarse grid, so many tokens tie, at the k-th place too: the draw must take the tied ids in id
    # order, as the official whole-vocabulary stable sort does, or the same seed draws another token.
    levels = torch.randint(0, 8, (4097,), generator=torch.Generator().manual_seed(3)).float()
    probs = levels / levels.sum()
    kth = probs.sort(descending=True, stable=True).values[min(top_k, probs.numel()) - 1]
    assert int((probs == kth).sum()) > 1
    for top_p in (0.05, 0.8, 1.0):
        for seed in range(20):
            ours = nucleus_sample(probs, top_p, top_k, make_generator(seed))
            assert ours == official_nucleus_sample(probs, top_p, top_k, make_generator(seed)), (top_p, seed)


def test_a_repeated_token_is_excluded_from_the_fallback_draw() -> None:
    scores = log_probs([0.4, 0.3, 0.2, 0.1])
    options = SamplingOptions(top_p=1.0, top_k=1, win_size=10, tau_r=0.1)  # the nucleus is token 0 only
    assert set(draws(scores, options, [1, 2, 3])) == {0}
    assert set(draws(scores, options, [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])) == {0}  # the 0 is outside the window
    # One repeat reaches win_size * tau_r = 1: official ras_sampling sets token 0 to -inf and draws from the rest.
    repeated = draws(scores, options, [3, 0])
    assert set(repeated) == {1, 2, 3}
    assert repeated.count(1) > repeated.count(3)  # the rest keep their relative weights (0.3 : 0.2 : 0.1)


def test_the_fallback_draw_follows_the_nucleus_draw_on_the_same_generator() -> None:
    scores = torch.log_softmax(torch.randn(16, generator=torch.Generator().manual_seed(3)), dim=0)
    options = SamplingOptions(top_p=0.8, top_k=5, win_size=4, tau_r=0.5)
    history = [int(scores.argmax())] * 4  # the likeliest token fills the window: any draw of it is replaced
    for seed in range(20):
        reference = make_generator(seed)
        ranked = scores.softmax(0).sort(descending=True, stable=True)
        kept = ranked.values[:5][(ranked.values[:5].cumsum(0) - ranked.values[:5]) < 0.8]
        token = int(ranked.indices[torch.multinomial(kept, 1, replacement=True, generator=reference)])
        if token == history[0]:
            rest = scores.clone()
            rest[token] = float("-inf")
            token = int(torch.multinomial(rest.softmax(0), 1, replacement=True, generator=reference))
        assert sample_token(scores, history, options, make_generator(seed)) == token


def test_the_only_candidate_is_kept_when_excluding_it_leaves_nothing() -> None:
    scores = torch.full((4,), float("-inf"))
    scores[2] = 0.0
    assert sample_token(scores, [2], SamplingOptions(top_k=1, win_size=1, tau_r=1.0), make_generator(0)) == 2


def test_masked_tokens_are_never_drawn_and_greedy_is_argmax() -> None:
    scores = log_probs([0.1, 0.6, 0.3])
    scores[1] = float("-inf")
    assert sample_token(scores, [], SamplingOptions(greedy=True), make_generator(0)) == 2
    assert 1 not in draws(scores, SamplingOptions(top_p=1.0, tau_r=0.0), [])  # tau_r 0: always the fallback draw


@pytest.mark.parametrize(
    "bad",
    [
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"top_k": 2.5},
        {"win_size": 0},
        {"tau_r": -0.1},
        {"min_token_text_ratio": -1.0},
        {"max_token_text_ratio": 1.0, "min_token_text_ratio": 2.0},
        {"seed": -1},
        {"seed": "7"},
        {"greedy": "yes"},
        {"mask_all_stop_ids_before_min_len": 1},
    ],
)
def test_invalid_sampling_options(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidInputError):
        SamplingOptions(**bad)


@pytest.mark.parametrize(
    ("node", "key", "value"),
    [
        ("text_encoder", "use_cnn_module", True),
        ("text_encoder", "macaron_style", True),
        ("text_encoder", "pos_enc_layer_type", "rel_pos"),
        ("llm", "static_chunk_size", 0),
        ("llm", "input_layer", "conv2d"),
    ],
)
def test_unsupported_configs_are_rejected(conformance_kit: Path, node: str, key: str, value: Any) -> None:
    spec = load_model_yaml(conformance_kit / "model" / "cosyvoice.yaml")["llm"]
    spec[node].kwargs[key] = value
    with pytest.raises(CheckpointError):
        LLMConfig.from_yaml(spec)
    spec.target = "cosyvoice.llm.llm.Qwen2LM"
    with pytest.raises(CheckpointError, match="Qwen2LM"):
        LLMConfig.from_yaml(spec)
