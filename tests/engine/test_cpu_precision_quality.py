"""Reduced precision on CPU against float32 on the conformance kits: what `dtype: auto` picks for a
real-size model (INT8 or bfloat16 LLM, bfloat16 flow) must stay close to float32, stage by stage, on float32 inputs.
Runs where the CPU has native bfloat16 (AMX or AVX512-BF16); elsewhere bfloat16 is emulated and never chosen.

No bound on the waveforms: the kits' random-weight vocoders are chaotic (rounding only their float32 input mel to
bfloat16 leaves a waveform at 6-13 dB SNR against float32's; `benchmarks.cpu_bench` reports it as
`float32_on_rounded_mel`), so a waveform bound would measure that, not the precision. The real-size dummies' vocoders
are not (38-46 dB in bfloat16); `auto` keeps the vocoder float32 all the same (docs/performance.md)."""

from __future__ import annotations

import pytest

from benchmarks.cpu_bench import run
from engine.nn.precision import cpu_capabilities
from tests.conftest import version_kit

pytestmark = pytest.mark.skipif(
    not cpu_capabilities().native_bfloat16,
    reason=f"no native bfloat16 on this CPU ({cpu_capabilities().describe()}): auto never picks it here",
)


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2, 3])
def test_reduced_precision_stages_stay_close_to_float32(version: int) -> None:
    kit = version_kit(version)
    result = run(str(kit / "model"), audio_seconds=0.5, threads=2, repeats=1, warmup=0, quality_only=True)
    quality = result["quality"]
    assert quality["flow"]["bfloat16"]["cosine"] >= 0.999  # the mel, from the float32 tokens
    for variant, bound in (("bfloat16", 0.995), ("int8", 0.9)):
        first_step = quality["llm"][variant]
        assert first_step["first_step_same_top1"], variant
        assert first_step["first_step_probabilities"]["cosine"] >= bound, variant
    assert result["choice"] == {"llm": "float32", "flow": "float32", "hift": "float32"}  # a tiny model: float32
