"""The `auto` memory budget of a decoder (engine.runtime.memory): a device share less the weights and a reserve."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from engine.runtime import memory
from engine.runtime.memory import device_memory_budget, memory_budget_for
from serve_app.args import DecoderArgs

GIB = 2**30


def test_the_budget_is_the_share_less_the_weights_and_a_tenth_reserve() -> None:
    assert memory_budget_for(4 * GIB, GIB) == 4 * GIB - GIB - int(0.4 * GIB)


def test_a_small_share_keeps_at_least_256_mib_in_reserve() -> None:
    assert memory_budget_for(GIB, GIB // 2) == GIB - GIB // 2 - (256 << 20)


def test_a_share_the_weights_fill_is_refused_with_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"share of 1.00 GiB holds 0.90 GiB of weights"):
        memory_budget_for(GIB, int(0.9 * GIB))


def test_on_cpu_auto_sets_no_byte_bound() -> None:
    assert device_memory_budget(torch.device("cpu"), 0.5) is None


@pytest.mark.parametrize(("share", "expected_share_bytes"), [(0.25, 4 * GIB), (None, 16 * GIB), (1.0, 16 * GIB)])
def test_on_cuda_auto_takes_the_replicas_fraction_of_the_card(
    monkeypatch: pytest.MonkeyPatch, share: float | None, expected_share_bytes: int
) -> None:
    # no GPU here: the card's size and the allocated weights are what CUDA would report
    card = SimpleNamespace(total_memory=16 * GIB)
    monkeypatch.setattr(memory.torch.cuda, "get_device_properties", lambda device: card)
    monkeypatch.setattr(memory.torch.cuda, "memory_allocated", lambda device: GIB)
    budget = device_memory_budget(torch.device("cuda", 0), share)
    assert budget == memory_budget_for(expected_share_bytes, GIB)


def test_the_app_args_take_auto_a_size_or_none() -> None:
    assert DecoderArgs().memory_budget_gb == "auto"
    assert DecoderArgs(memory_budget_gb=2.5).memory_budget_gb == 2.5
    assert DecoderArgs(memory_budget_gb=None).memory_budget_gb is None
    for bad in (0, -1, "big"):
        with pytest.raises(ValidationError):
            DecoderArgs(memory_budget_gb=bad)
