"""The official CosyVoice code's decoder stages, timed for benchmarks/official_bench.py: run ONLY with the venv that
has the official dependencies (docs/parity.md, "Conformance kits"), as a subprocess, never imported into the project.

    /tmp/offvenv/bin/python benchmarks/official_worker.py --official /tmp/cosyvoice-official \\
        --yaml engine/loading/presets/cosyvoice-300m.yaml --inputs inputs.pt --threads 2

Builds the yaml's `llm`, `flow` and `hift` with random weights (`torch.manual_seed(seed)`, the official
initialization; timing does not depend on the values), then reads one stage name per line on stdin (`llm`, `flow`,
`hift`) and answers each with one JSON line `{"stage", "seconds", "tokens" | "frames" | "samples"}`, after `ready`.
Each stage is called as the official `CosyVoiceModel` (v1) calls it in a non-streaming `tts`: `llm.inference` over
the whole text (the text encoder included) with min = max tokens, `flow.inference` over all the tokens with an empty
prompt, `hift.inference` of the whole mel with an empty cache source. The inputs file holds `text` [1, N] int32,
`speech_tokens` [1, T] int32 (the flow's input), `mel` [1, 80, F] (the vocoder's), `embedding` [1, 192].
Only the v1 `TransformerLM` / `MaskedDiffWithXvec` / `HiFTGenerator` are wired here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch


def build(official: Path, yaml_path: Path, seed: int) -> dict[str, Any]:
    sys.path[:0] = [str(official), str(official / "third_party" / "Matcha-TTS")]
    from hyperpyyaml import load_hyperpyyaml

    torch.manual_seed(seed)
    with open(yaml_path) as f:
        configs = load_hyperpyyaml(f)
    modules = {name: configs[name].eval() for name in ("llm", "flow", "hift")}
    for name, module in modules.items():
        kind = type(module).__name__
        if kind not in ("TransformerLM", "MaskedDiffWithXvec", "HiFTGenerator"):
            sys.exit(f"official_worker: {name} is {kind}; only the v1 classes are wired")
    return modules


def run_stage(stage: str, modules: dict[str, Any], inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One official call of `stage` on the inputs; its seconds and output size."""
    empty_int = torch.zeros(1, 0, dtype=torch.int32)
    none = torch.tensor([0], dtype=torch.int32)
    started = time.perf_counter()
    if stage == "llm":
        text, tokens = inputs["text"], inputs["speech_tokens"].shape[1]
        ratio = (tokens + 0.5) / text.shape[1]  # min = max = `tokens` (half a token over: the float product)
        out = list(
            modules["llm"].inference(
                text=text,
                text_len=torch.tensor([text.shape[1]], dtype=torch.int32),
                prompt_text=empty_int,
                prompt_text_len=none,
                prompt_speech_token=empty_int,
                prompt_speech_token_len=none,
                embedding=inputs["embedding"],
                max_token_text_ratio=ratio,
                min_token_text_ratio=ratio,
            )
        )
        size = {"tokens": len(out)}
    elif stage == "flow":
        token = inputs["speech_tokens"]
        mel, _ = modules["flow"].inference(
            token=token,
            token_len=torch.tensor([token.shape[1]], dtype=torch.int32),
            prompt_token=empty_int,
            prompt_token_len=none,
            prompt_feat=torch.zeros(1, 0, 80),
            prompt_feat_len=none,
            embedding=inputs["embedding"],
            flow_cache=torch.zeros(1, 80, 0, 2),
        )
        size = {"frames": mel.shape[2]}
    elif stage == "hift":
        speech, _ = modules["hift"].inference(speech_feat=inputs["mel"], cache_source=torch.zeros(1, 1, 0))
        size = {"samples": speech.shape[1]}
    else:
        raise ValueError(f"unknown stage {stage!r}")
    return {"stage": stage, "seconds": time.perf_counter() - started, **size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official", type=Path, required=True, help="the official CosyVoice checkout")
    parser.add_argument("--yaml", type=Path, required=True, help="a v1 yaml with the llm, flow and hift nodes")
    parser.add_argument("--inputs", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modules = build(args.official, args.yaml, args.seed)
    inputs = torch.load(args.inputs, weights_only=True)
    print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
    with torch.inference_mode():
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(run_stage(line.strip(), modules, inputs)), flush=True)


if __name__ == "__main__":
    main()
