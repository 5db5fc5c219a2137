"""Thin dtype-safe layers: weights may be fp16/bf16, numerically fragile ops run in fp32.

Following whisper's model.py: LayerNorm, softmax and log-softmax compute in fp32 and cast back, and
Linear/Conv cast their input to the weight dtype, so a module converted with `.half()` really holds
half-precision weights and stays finite. Inside `float32_compute()` Linear and Conv1d compute in fp32 from
their low-precision weights instead (the NaN guard's recompute, engine.nn.precision).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def length_mask(lengths: Tensor, max_length: int) -> Tensor:
    """[B] lengths -> [B, max_length] bool, True on each row's first `lengths[b]` positions."""
    return torch.arange(max_length, device=lengths.device) < lengths.unsqueeze(1)


def time_mask(lengths: Tensor, size: int, dtype: torch.dtype) -> Tensor:
    """[B] valid lengths -> [B, 1, size] in `dtype`: ones on the valid steps, zeros on the padding (it broadcasts
    over the channels of a [B, C, T] tensor)."""
    return length_mask(lengths, size).to(dtype)[:, None, :]


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


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        weight, bias = _compute_weights(self)
        return F.linear(x.to(weight.dtype), weight, bias)


class PackedLinear(nn.Module):
    """A float32 CPU Linear whose weight is pre-packed for oneDNN (`engine.nn.precision.pack_linear_for_cpu`).

    For the few rows of a decode step MKL's GEMM is slow (8 rows of a 4096x1024 layer cost 3x one row);
    oneDNN with a weight packed once runs them in about 1.4x one row. Inference only: the weight is not a
    parameter, and copies and pickles carry it as a plain tensor and pack it again.
    """

    def __init__(self, weight: Tensor, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed_weight = _pack(weight)
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        """x [..., in_features] -> [..., out_features], computed in float32 and returned in x's dtype."""
        out = torch.ops.mkldnn._linear_pointwise(x.float(), self.packed_weight, self.bias, "none", [], "")
        return out.to(x.dtype)

    def dense_weight(self) -> Tensor:
        return self.packed_weight.to_dense()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["packed_weight"] = self.dense_weight()  # an opaque oneDNN tensor has no storage to copy
        return state

    def __setstate__(self, state: dict) -> None:
        state["packed_weight"] = _pack(state["packed_weight"])
        self.__dict__.update(state)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _pack(weight: Tensor) -> Tensor:
    # the batch-size hint only tunes the layout; any number of rows works
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), 8)


class Int4Linear(nn.Module):
    """A CPU Linear whose weight is stored in 4 bits, in groups of `group_size` inputs that each have a bfloat16 scale
    and offset (weight-only quantization; `engine.nn.precision.quantize_linear_int4`). A batch-1 decode step reads
    every weight once, so an eighth of float32's bytes (plus the scales) makes that read faster; torch's packed
    kernel takes bfloat16 rows (float32 ones fall to a path ~20x slower), so the input is rounded to bfloat16 and
    the output comes back in float32 before the bias is added.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, group_size: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        codes, scales_and_offsets = int4_groups(weight.detach().float(), group_size)
        # Plain attributes, not buffers, as PackedLinear's weight: the kernel reads these dtypes, so casts leave them
        self.packed_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.scales_and_offsets = scales_and_offsets  # [in / group, out, 2] bfloat16
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        """x [..., in_features] -> [..., out_features] in x's dtype."""
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed_weight, self.group_size, self.scales_and_offsets
        )
        out = out.float() if self.bias is None else torch.add(self.bias, out)  # the sum is float32: one operation
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def int4_groups(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """weight [out, in] float32 -> (codes [out, in] int32 in 0..15, scales and offsets [in / group_size, out, 2]
    bfloat16), each group of `group_size` inputs of a row spread evenly over its own min..max:
    weight ~= (code - 8) * scale + offset, the form torch's int4 kernel reads."""
    out_features, in_features = weight.shape
    groups = weight.view(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny)
    codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).view(out_features, in_features)
    offset = low + 8 * scale
    scales_and_offsets = torch.stack((scale, offset), dim=-1).view(out_features, -1, 2).transpose(0, 1)
    return codes, scales_and_offsets.contiguous().to(torch.bfloat16)


class Conv1d(nn.Conv1d):
    def forward(self, x: Tensor) -> Tensor:
        weight, bias = _compute_weights(self)
        return self._conv_forward(x.to(weight.dtype), weight, bias)


class CausalConv1d(Conv1d):
    """Stride-1 Conv1d over zeros on the left only: output t reads inputs t - dilation (kernel - 1) .. t."""

    def forward(self, x: Tensor) -> Tensor:
        """[B, in_channels, T] -> [B, out_channels, T]."""
        return super().forward(F.pad(x, (self.dilation[0] * (self.kernel_size[0] - 1), 0)))


class ConvTranspose1d(nn.ConvTranspose1d):
    def forward(self, x: Tensor, output_size: list[int] | None = None) -> Tensor:
        return super().forward(x.to(self.weight.dtype), output_size)


def softmax_fp32(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax computed in fp32, returned in the input dtype."""
    return torch.softmax(x.float(), dim=dim).type(x.dtype)


def log_softmax_fp32(x: Tensor, dim: int = -1) -> Tensor:
    """Log-softmax in fp32; stays fp32 because sampling compares log-probabilities."""
    return torch.log_softmax(x.float(), dim=dim)


def apply_mask(x: Tensor, mask: Tensor | None) -> Tensor:
    """x * mask; `None` stands for a batch without padding, where the product would only copy x."""
    return x if mask is None else x * mask


_FLOAT32_COMPUTE: ContextVar[bool] = ContextVar("float32_compute", default=False)


@contextmanager
def float32_compute() -> Iterator[None]:
    """Within the block `Linear` and `Conv1d` compute in float32 whatever their weights' dtype (the weights are
    cast per call; the modules keep theirs) and `compute_dtype` answers float32: one request recomputed at full
    precision with no float32 copy of the model. Per thread and task (a context variable)."""
    token = _FLOAT32_COMPUTE.set(True)
    try:
        yield
    finally:
        _FLOAT32_COMPUTE.reset(token)


def compute_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype layers whose weights are `weight_dtype` compute in: that one, or float32 in `float32_compute()`."""
    return torch.float32 if _FLOAT32_COMPUTE.get() else weight_dtype


def _compute_weights(layer: nn.Linear | nn.Conv1d) -> tuple[Tensor, Tensor | None]:
    weight = layer.weight  # read once: a weight-normed weight is recomputed on every read
    dtype = compute_dtype(weight.dtype)
    return weight.to(dtype), None if layer.bias is None else layer.bias.to(dtype)
