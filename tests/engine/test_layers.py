"""oneDNN-packed Linear layers (`pack_linear_for_cpu`): the same products as the plain layers, in place; packing and
INT8 quantization leave a Linear tied to another parameter alone."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.nn.quantized import dynamic as quantized_dynamic

from engine.loading.loader import load_model
from engine.nn.layers import Linear, PackedLinear
from engine.nn.precision import cpu_packing_available, pack_linear_for_cpu, parameter_bytes, quantize_linear_int8

pytestmark = pytest.mark.skipif(not cpu_packing_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16, 17, 300])
def test_a_packed_linear_computes_the_plain_product(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    plain = Linear(96, 40, bias=bias)
    packed = PackedLinear(plain.weight, plain.bias)
    x = torch.randn(rows, 1, 96)  # a decode step's [B, 1, D] layout
    out = packed(x)
    assert out.shape == (rows, 1, 40)
    torch.testing.assert_close(out, F.linear(x, plain.weight, plain.bias), atol=1e-5, rtol=1e-5)
    rows_alone = torch.cat([packed(x[i : i + 1]) for i in range(rows)])
    torch.testing.assert_close(out, rows_alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("transform", "swapped_class", "tolerance"),
    [(pack_linear_for_cpu, PackedLinear, 1e-6), (quantize_linear_int8, quantized_dynamic.Linear, 0.1)],
)
def test_packing_and_quantization_swap_layers_in_place_but_not_tied_ones(transform, swapped_class, tolerance) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Linear(8, 8), nn.ReLU(), Linear(8, 8, bias=False))
    tied = nn.Embedding(8, 8)
    model[2].weight = tied.weight  # like CosyVoice2's and 3's text lm_head
    model.append(tied)
    bytes_before = parameter_bytes(model)
    x = torch.randn(3, 8)
    expected = model[2](model[1](model[0](x)))
    transform(model)
    assert isinstance(model[0], swapped_class) and type(model[2]) is Linear and model[2].weight is tied.weight
    assert parameter_bytes(model) <= bytes_before  # no second copy of the tied weight
    torch.testing.assert_close(model[2](model[1](model[0](x))), expected, atol=tolerance, rtol=tolerance)


def test_packed_layers_survive_copies_and_pickles() -> None:
    layer = PackedLinear(torch.randn(16, 8), nn.Parameter(torch.randn(16)))
    x = torch.randn(4, 8)
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert isinstance(other, PackedLinear)
        torch.testing.assert_close(other(x), layer(x), atol=0, rtol=0)
    assert torch.equal(layer.dense_weight(), copy.deepcopy(layer).dense_weight())


def test_the_loader_packs_the_float32_cpu_llm_and_counts_its_bytes() -> None:
    packed, plain = load_model("tiny"), load_model("tiny", cpu_packing=False)
    assert any(isinstance(m, PackedLinear) for m in packed.llm.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.llm.modules())
    assert parameter_bytes(packed.llm) == parameter_bytes(plain.llm)
    int8 = load_model("tiny", int8=True)
    assert not any(isinstance(m, PackedLinear) for m in int8.llm.modules())
