"""Thin dtype-safe layers: weights may be fp16/bf16, numerically fragile ops run in fp32.

Following whisper's model.py: LayerNorm, softmax and log-softmax compute in fp32 and cast back, and
Linear/Conv cast their input to the weight dtype, so a module converted with `.half()` really holds
half-precision weights and stays finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LayerNorm(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).type(x.dtype)


class GroupNorm(nn.GroupNorm):
    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.group_norm(x.float(), self.num_groups, weight, bias, self.eps).type(x.dtype)


# Up to this many input rows, CPU float32 Linear layers compute W @ x^T instead of x @ W^T: for a few rows
# (batched decode steps) MKL's small-m GEMM is 2-3x slower than reading the weights once in this order.
WEIGHT_MAJOR_MAX_ROWS = 128


def _weight_major_columns(rows: int) -> int:
    """Columns to give W @ x^T for `rows` rows: MKL (AVX2) has fast kernels for 4 and 16 columns, and 5-15
    columns take longer than 16 (8 rows of a 4096x1024 layer: 2.1 ms, padded to 16: 1.6 ms), so pad up to those.
    """
    return 4 if rows <= 4 else 16 if rows <= 16 else rows


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        x = x.to(self.weight.dtype)
        rows = x.numel() // self.in_features if self.in_features else 0
        if 1 < rows <= WEIGHT_MAJOR_MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32:
            columns = x.reshape(rows, self.in_features).t()
            columns = F.pad(columns, (0, _weight_major_columns(rows) - rows))  # zero columns: results unaffected
            out = (
                torch.mm(self.weight, columns)
                if self.bias is None
                else torch.addmm(self.bias[:, None], self.weight, columns)
            )
            return out[:, :rows].t().reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


class Conv1d(nn.Conv1d):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.to(self.weight.dtype))


class ConvTranspose1d(nn.ConvTranspose1d):
    def forward(self, x: Tensor, output_size: list[int] | None = None) -> Tensor:
        return super().forward(x.to(self.weight.dtype), output_size)


def softmax_fp32(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax computed in fp32, returned in the input dtype."""
    return torch.softmax(x.float(), dim=dim).type(x.dtype)


def log_softmax_fp32(x: Tensor, dim: int = -1) -> Tensor:
    """Log-softmax in fp32; stays fp32 because sampling compares log-probabilities."""
    return torch.log_softmax(x.float(), dim=dim)
