"""The thin layers: the few-row CPU path of `Linear` computes the same product as `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import WEIGHT_MAJOR_MAX_ROWS, Linear


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 15, 16, 17, WEIGHT_MAJOR_MAX_ROWS, WEIGHT_MAJOR_MAX_ROWS + 1])
def test_linear_matches_f_linear_for_any_row_count(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 40, bias=bias)
    x = torch.randn(rows, 1, 96)  # a decode step's [B, 1, D] layout
    out = layer(x)
    assert out.shape == (rows, 1, 40)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_each_row_is_independent_of_the_others() -> None:
    torch.manual_seed(0)
    layer = Linear(64, 32)
    batch = torch.randn(8, 64)
    together = layer(batch)
    alone = torch.cat([layer(batch[i : i + 1]) for i in range(8)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_half_precision_weights_take_the_plain_path() -> None:
    layer = Linear(32, 16).half()
    out = layer(torch.randn(8, 32))  # fp32 input is cast to the weight dtype
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
