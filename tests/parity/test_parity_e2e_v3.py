"""CosyVoice3 end to end on the v3 kit: our LLM's tokens -> our flow -> our vocoder equals the official chain,
and the loader builds v3 model dirs and presets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.families.base import ModelConfig
from engine.flow.dit import CausalMaskedDiffWithDiT
from engine.llm.cosyvoice3_lm import CosyVoice3LM, CosyVoice3TextEmbedding
from engine.loading.loader import PRESETS_DIR, load_model, load_module
from engine.vocoder.causal_hift import CausalHiFTGenerator
from tests.conftest import v3_kit_cases, v3_kit_dir
from tests.parity.test_parity_flow import request_of  # the same case fields in every kit
from tests.parity.test_parity_llm import kit_request

ATOL = 1e-4


@pytest.fixture(scope="module")
def kit() -> Path:
    return v3_kit_dir()


def _case(cases: list[dict[str, Any]], key: str, value: str) -> dict[str, Any]:
    found = [case for case in cases if case.get(key, "").startswith(value)]
    if not found:
        pytest.skip(f"the kit has no case with {key} {value!r}")
    return found[0]


def test_official_chain_end_to_end(kit: Path) -> None:
    """The kit's e2e cases chain llm -> flow -> hift; each stage runs on our previous stage's output."""
    cases = v3_kit_cases(kit)
    flow_case = _case(cases["flow"], "e2e_source", "token = out_tokens of llm case")
    hift_case = _case(cases["hift"], "e2e_source", "mel = feat of flow case")
    llm_name = flow_case["e2e_source"].split("llm case ")[1].split(";")[0]
    llm_case = dict(_case(cases["llm"], "name", llm_name), embedding=torch.zeros(0))
    llm, flow, hift = (load_module(kit / "model", name) for name in ("llm", "flow", "hift"))
    assert isinstance(llm, CosyVoice3LM) and isinstance(flow, CausalMaskedDiffWithDiT)
    assert isinstance(hift, CausalHiFTGenerator)

    (tokens,) = llm.generate([kit_request(llm, llm_case)])
    assert torch.equal(tokens, flow_case["token"][0].long())
    request = request_of(flow_case)
    request.tokens = tokens
    (mel,) = flow.inference([request])
    torch.testing.assert_close(mel, hift_case["mel"][0], atol=ATOL, rtol=0)
    with torch.inference_mode():
        speech = hift.decode(mel[None], hift_case["source"])
    torch.testing.assert_close(speech, hift_case["speech"], atol=ATOL, rtol=0)


def test_presets_build() -> None:
    tiny = load_model("cosyvoice3-tiny")
    assert tiny.config.version == 3 and tiny.config.sample_rate == 24000
    assert isinstance(tiny.text_llm, CosyVoice3TextEmbedding) and isinstance(tiny.hift, CausalHiFTGenerator)
    released = ModelConfig.from_yaml_file(PRESETS_DIR / "cosyvoice3-0.5b" / "cosyvoice3.yaml")
    assert (released.llm.speech_token_size, released.flow.estimator.depth, released.hift.base_channels) == (
        6561,
        22,
        512,
    )
