"""The HiFT parity check stage by stage, teacher-forced, shared by the v1/v2 (`HiFTGenerator`) and v3
(`CausalHiFTGenerator`) tests.

Each stage of our vocoder is fed the official tensor before it (`teacher_forced`), not our own, and its output is
compared with the official one: one stage's rounding is not charged to the stages after it, where it grows (1e-4 Hz
in f0 moves the source phase; the upsampling stages grow a conv_pre difference of 1e-5 into 1e-3 of speech). So a
stage's tolerance can be the official code's own variation at that stage, which the kit records per case and tensor
(`spread_<tensor>`; tools/make_conformance_kit.py, `hidden_with_spread`), grown by another CPU's rounding.

The bounds, by where the reference was recorded (`recorded_cpu_kind`): another CPU kind (`tolerance`: SPREAD_FACTOR x
the spread, at least ROUNDING_FLOOR of the peak); end to end (`e2e_speech_tolerance`: E2E_SPREAD_FACTOR x
`spread_e2e_speech`); this machine's CPU kind (`same_kind_tolerance`: a few float32 ulps, the only bound tight enough
to see a rounding-order change inside a stage such as a fused Snake, `fused_snake`). Each bound's measurements and
the factor it leaves: docs/parity.md, "HiFT: each stage fed the official tensor before it".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import torch
from torch import Tensor, nn

from engine.nn.precision import cpu_capabilities
from engine.vocoder.hift import _SNAKE_EPS, Snake

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
E2E_SPREAD_FACTOR = 8.0
ROUNDING_FLOOR = 2e-6  # of a tensor's peak: a few float32 ulps, for the elementwise kernels of another CPU
SAME_KIND_ULPS = 4  # on this CPU kind every stage but the iSTFT measured bit for bit
FLOAT32_EPS = torch.finfo(torch.float32).eps


def compared(key: str, value: Tensor) -> Tensor:
    """What is compared (as the kit maker's spread): the log of the magnitudes, which exp() makes up to e^5 and
    more, and every other tensor as it is."""
    return value.double().log() if key == "magnitude" else value.double()


def same_kind_cases(reference_sets: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The cases every tensor of which was recorded on this machine's CPU kind (their `recorded_cpu_kind`); a case
    that does not say (kept from earlier kits: its tensors may come from several machines) is not one. Skips the
    caller when there are none."""
    kind = cpu_capabilities().kernel_kind
    cases = [case for cases in reference_sets.values() for case in cases if case.get("recorded_cpu_kind") == kind]
    if not cases:
        pytest.skip(
            f"this kit records no hift case on this machine's CPU kind ({kind}): tools/make_conformance_kit.py "
            "--references (CosyVoice3: tools/make_cosyvoice3_kit.py --references) records them"
        )
    return cases


def require_spread_fields(cases: list[dict[str, Any]], kit: Path) -> None:
    """Fail, naming the field and the command that adds it, when a case lacks the spread of a tensor the tests
    compare (a kit made before the tools recorded spreads, or by other tools). f0 has none (a fixed bound), nor
    does a source recorded without its sines: it is an input then."""
    for case in cases:
        compared = [key for key in HIFT_PIPELINE[1:] if key in case and (key != "source" or "source_sine" in case)]
        if runs_end_to_end(case):
            compared.append("e2e_speech")
        missing = [f"spread_{key}" for key in compared if f"spread_{key}" not in case]
        if missing:
            tool = "make_cosyvoice3_kit.py" if "finalize" in case else "make_conformance_kit.py"
            pytest.fail(
                f"conformance kit {kit}: hift case {case['name']!r} has no {', '.join(missing)} (a kit in an older "
                f"format): add them with `python tools/{tool} --official <CosyVoice checkout> --out {kit} --respread`"
            )


def runs_end_to_end(case: dict[str, Any]) -> bool:
    """Whether the case's speech can be made from its mel alone: its source's random draws are recorded (v1/v2),
    or the source comes from the model's fixed buffers (v3, whose cases record `finalize`)."""
    return bool(case.get("rand_draw_order")) or "finalize" in case


def e2e_speech_tolerance(case: dict[str, Any]) -> float:
    """The bound on speech made from the mel alone: E2E_SPREAD_FACTOR x the official code's end-to-end spread, at
    least ROUNDING_FLOOR of the peak (why it holds across CPU kinds: the module docstring)."""
    return max(E2E_SPREAD_FACTOR * case["spread_e2e_speech"], ROUNDING_FLOOR * float(case["speech"].abs().max()))


def tolerance(case: dict[str, Any], key: str, fixed: dict[str, float]) -> float:
    """The bound against a reference of another CPU kind: `fixed[key]` where given (tensors without a recorded
    spread), else SPREAD_FACTOR x the case's spread of the tensor, at least ROUNDING_FLOOR of its peak."""
    if key in fixed:
        return fixed[key]
    peak = float(compared(key, case[key]).abs().max())
    return max(SPREAD_FACTOR * case[f"spread_{key}"], ROUNDING_FLOOR * peak)


def same_kind_tolerance(case: dict[str, Any], key: str, fixed: dict[str, float]) -> float:
    """The bound against a reference recorded on this machine's CPU kind: SAME_KIND_ULPS float32 ulps of the
    tensor's peak; for the speech, ROUNDING_FLOOR of its peak, since our iSTFT is written out (an overlap-add by
    `fold`) and rounds otherwise than torch.istft (1.2e-7 of a peak of 0.99 measured); `fixed[key]` where given."""
    if key in fixed:
        return fixed[key]
    peak = float(compared(key, case[key]).abs().max())
    return ROUNDING_FLOOR * peak if key == "speech" else SAME_KIND_ULPS * FLOAT32_EPS * peak


def assert_pipeline(
    actual: dict[str, Tensor],
    case: dict[str, Any],
    fixed: dict[str, float],
    bound: Callable[[dict[str, Any], str, dict[str, float]], float] = tolerance,
) -> list[str]:
    """Compare every tensor `case` and `actual` both hold, in HIFT_PIPELINE order (ours may be wider: padded
    frames past the official ones), each within `bound(case, key, fixed)`; returns the keys compared."""
    keys = [key for key in HIFT_PIPELINE if key in case and key in actual]
    for key in keys:
        expected = compared(key, case[key])
        ours = compared(key, actual[key])[..., : expected.shape[-1]]
        atol = bound(case, key, fixed)
        torch.testing.assert_close(
            ours,
            expected,
            atol=atol,
            rtol=0,
            msg=lambda message, key=key, atol=atol: (
                f"{case['name']}: {key}, fed the official tensors before it, is off the official one (atol "
                f"{atol:.2e}): {message}"
            ),
        )
    return keys


def _handed_on(ours: Tensor, official: Tensor) -> Tensor:
    """`official` where it reaches, `ours` past it (ours may be wider: padded frames past the official ones)."""
    forced = ours.clone()
    forced[..., : official.shape[-1]] = official.to(ours.dtype)
    return forced


@contextmanager
def teacher_forced(hift: nn.Module, case: dict[str, Any], out: dict[str, Tensor]) -> Iterator[None]:
    """While in the context, each stage of `hift` records its own output into `out` and hands the next stage the
    official tensor of `case` instead, where the case holds it: the source module's linear layer gets the official
    `source_sine` [B, L, harmonics + 1] and its tanh the official `source_linear` [B, L, 1]; decode's upsampling
    stack gets the official `conv_pre_out` and `s_stft` (the source spectrum), its output stage the official
    `conv_post_out`, and the iSTFT the official `magnitude` and `phase` [B, n_fft/2 + 1, frames]."""

    def recorded(key: str, value: Tensor) -> Tensor:
        out[key] = value
        return _handed_on(value, case[key]) if key in case else value

    istft: Callable[..., Tensor] = hift._istft
    source_spectrum: Callable[..., Tensor] = hift._source_spectrum

    def forced_istft(magnitude: Tensor, phase: Tensor, frame_lengths: Tensor) -> Tensor:
        return istft(recorded("magnitude", magnitude), recorded("phase", phase), frame_lengths)

    def forced_source_spectrum(*args: Any) -> Tensor:
        return recorded("s_stft", source_spectrum(*args))

    linear = hift.m_source.l_linear
    with ExitStack() as stack:
        for hook in (
            linear.register_forward_pre_hook(lambda _m, i: (recorded("source_sine", i[0]),)),
            linear.register_forward_hook(lambda _m, _i, o: recorded("source_linear", o)),
            hift.conv_pre.register_forward_hook(lambda _m, _i, o: recorded("conv_pre_out", o)),
            hift.conv_post.register_forward_hook(lambda _m, _i, o: recorded("conv_post_out", o)),
        ):
            stack.callback(hook.remove)
        hift._istft, hift._source_spectrum = forced_istft, forced_source_spectrum
        try:
            yield
        finally:
            del hift._istft, hift._source_spectrum


def assert_stages_to_the_float32_floor(
    stages: Callable[[dict[str, Any]], dict[str, Tensor]],
    cases: list[dict[str, Any]],
    fixed: Callable[[dict[str, Any]], dict[str, float]],
) -> None:
    """Every case's stages (`stages(case)`, teacher-forced) within `same_kind_tolerance` (`fixed(case)`: the bounds
    of tensors without a recorded spread)."""
    for case in cases:
        assert_pipeline(stages(case), case, fixed=fixed(case), bound=same_kind_tolerance)


@contextmanager
def fused_snake() -> Iterator[None]:
    """While in the context, Snake computes `x + 1/alpha * sin^2(alpha x)` with the product and the sum rounded once
    (`torch.addcmul`), not apart as the official code does: a bug the vocoder once had, which the float32 floor must
    see."""

    def forward(snake: Snake, x: Tensor) -> Tensor:
        alpha = snake.alpha.float()[None, :, None]
        sine = torch.sin(x.float() * alpha)
        return torch.addcmul(x.float(), 1.0 / (alpha + _SNAKE_EPS), sine * sine).to(x.dtype)

    with patch.object(Snake, "forward", forward):
        yield
