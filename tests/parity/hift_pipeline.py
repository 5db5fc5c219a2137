"""The HiFT parity check in pipeline order, shared by the v1/v2 (`HiFTGenerator`) and v3 (`CausalHiFTGenerator`)
tests: our tensors are compared with a kit case's in the order the vocoder makes them, so the first assertion that
fails names the first tensor that diverges.

Tolerances come from the kit: its maker ran the official code again with two intra-op threads and with the native
convolution kernels instead of oneDNN's, and recorded per case and tensor the largest difference from its
one-thread run (`spread_<tensor>`; tools/make_conformance_kit.py, `hidden_with_spread`). Our vocoder computes in
the official order (at one thread on the kit's machine it gives the official conv_post bit for bit), so what is
left is that rounding spread, grown by the CPU and kernels a test runs on. The tolerance of a tensor is
SPREAD_FACTOR times its recorded spread: the largest ratio measured between a run on another machine and the
spread is 2.0 (v2 `cache_source_from_stream` conv_post_out: 3.0e-5 against 1.5e-5; v3 conv_post_out 2.0e-4
against 1.2e-4, speech 7e-6 against 5e-6), so 4 leaves a factor 2. Tensors whose official computation does not
vary (the source, conv_pre: spread 0) get the float32 floor, ROUNDING_FLOOR of their peak; never less.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

# The recorded tensors in the order the official vocoder makes them (a case holds the ones it recorded).
HIFT_PIPELINE = (
    "f0",
    "source_sine",
    "source_linear",
    "source",
    "s_stft",
    "conv_pre_out",
    "conv_post_out",
    "magnitude",
    "phase",
    "speech",
)
SPREAD_FACTOR = 4.0
ROUNDING_FLOOR = 2e-6  # of a tensor's peak: a few float32 ulps, for the elementwise kernels of another CPU


def compared(key: str, value: Tensor) -> Tensor:
    """What is compared (as the kit maker's spread): the log of the magnitudes, which exp() makes up to e^5 and
    more, and every other tensor as it is."""
    return value.double().log() if key == "magnitude" else value.double()


def tolerance(case: dict[str, Any], key: str, fixed: dict[str, float]) -> float:
    """`fixed[key]` where given (tensors without a recorded spread), else SPREAD_FACTOR x the case's spread of
    the tensor, at least ROUNDING_FLOOR of its peak."""
    if key in fixed:
        return fixed[key]
    peak = float(compared(key, case[key]).abs().max())
    return max(SPREAD_FACTOR * case[f"spread_{key}"], ROUNDING_FLOOR * peak)


def assert_pipeline(actual: dict[str, Tensor], case: dict[str, Any], fixed: dict[str, float]) -> list[str]:
    """Compare every tensor `case` and `actual` both hold, in HIFT_PIPELINE order (ours may be wider: padded
    frames past the official ones); returns the keys compared."""
    keys = [key for key in HIFT_PIPELINE if key in case and key in actual]
    for key in keys:
        expected = compared(key, case[key])
        ours = compared(key, actual[key])[..., : expected.shape[-1]]
        atol = tolerance(case, key, fixed)
        torch.testing.assert_close(
            ours,
            expected,
            atol=atol,
            rtol=0,
            msg=lambda message, key=key, atol=atol: (
                f"{case['name']}: {key} is the first tensor in pipeline order to diverge (atol {atol:.2e}): {message}"
            ),
        )
    return keys


@contextmanager
def captured_decode(hift: nn.Module, out: dict[str, Tensor]) -> Iterator[None]:
    """While in the context, `hift.decode` records into `out` what the kit records of the official decode:
    `s_stft` (the source spectrum), `conv_pre_out`, `conv_post_out`, and the `magnitude` and `phase` its
    `_istft` gets."""
    istft: Callable[..., Tensor] = hift._istft

    def recording_istft(magnitude: Tensor, phase: Tensor, frame_lengths: Tensor) -> Tensor:
        out.update(magnitude=magnitude, phase=phase)
        return istft(magnitude, phase, frame_lengths)

    hooks = [
        hift.conv_pre.register_forward_hook(lambda _m, _i, o: out.update(conv_pre_out=o)),
        hift.source_downs[0].register_forward_pre_hook(lambda _m, i: out.update(s_stft=i[0])),
        hift.conv_post.register_forward_hook(lambda _m, _i, o: out.update(conv_post_out=o)),
    ]
    hift._istft = recording_istft
    try:
        yield
    finally:
        del hift._istft
        for hook in hooks:
            hook.remove()


@contextmanager
def captured_source(hift: nn.Module, out: dict[str, Tensor]) -> Iterator[None]:
    """While in the context, the source module records the input and output of its linear layer into `out`
    (`source_sine` [B, L, harmonics + 1], `source_linear` [B, L, 1]), as the kit records the official ones."""
    hook = hift.m_source.l_linear.register_forward_hook(lambda _m, i, o: out.update(source_sine=i[0], source_linear=o))
    try:
        yield
    finally:
        hook.remove()
