"""Our decoder stages against the official CosyVoice code's, side by side in one run: per stage
RTF (and LLM ms per token) of the official code in float32, ours in float32 and ours with `--dtype` (auto: this
CPU's pick), at the same architecture with random weights, on the same inputs.

    python -m benchmarks.official_bench --model dummy --official /tmp/cosyvoice-official \\
        --official-python /tmp/offvenv/bin/python --out out/official_v1.json [--seconds 5] [--threads 2] [--repeats 3]

The official code runs in a subprocess of the venv that has its dependencies (benchmarks/official_worker.py; never
imported here), built from the same yaml with its own random weights (timing does not depend on the values). Both
LLMs make the same number of tokens; the official flow gets our tokens and its vocoder our mel; its LLM call includes
its text encoder (a few ms). Each round runs every stage of every variant in turn, so load on a shared machine hits
them alike. Only v1 models (the worker wires the v1 classes). The default run takes about 4 minutes on the 2-core
machine (Intel Xeon with AMX, 2026-12-07).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.cpu_bench import choice_for, load_variants, report_settings, speedup_fields
from benchmarks.engine_bench import bench_parser, fixed_length_segments
from engine.families import ModelConfig
from engine.loading.loader import PRESETS, PRESETS_DIR
from engine.runtime.encoder_stage import TextEncoderStage
from serve_app.bench.progress import BenchmarkRun
from serve_app.bench.timing import Timing, paired

STAGES = ("llm", "flow", "hift")
OVER_OFFICIAL = "_speedup_over_official"  # the key suffix of a variant's speed-up over the official code
WORKER = Path(__file__).with_name("official_worker.py")


class OfficialWorker:
    """The official stages in a subprocess (benchmarks/official_worker.py): `time(stage)` -> seconds."""

    def __init__(self, python: str, official: Path, yaml_path: Path, inputs: Path, threads: int) -> None:
        command = [python, str(WORKER), "--official", str(official), "--yaml", str(yaml_path)]
        command += ["--inputs", str(inputs), "--threads", str(threads)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._answer()
        self.sizes: dict[str, int] = {}

    def _answer(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the official worker exited (code {self.process.wait()}); see its stderr above")
        return json.loads(line)

    def time(self, stage: str) -> float:
        self.process.stdin.write(stage + "\n")
        self.process.stdin.flush()
        answer = self._answer()
        self.sizes[stage] = next(v for k, v in answer.items() if k not in ("stage", "seconds"))
        return float(answer["seconds"])

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def run(
    model_name: str,
    official: Path,
    official_python: str,
    audio_seconds: float,
    threads: int,
    repeats: int,
    warmup: int,
    dtype: str = "auto",
    bench: BenchmarkRun | None = None,
) -> dict[str, Any]:
    """The report (see the module docstring); each round's seconds go into `bench`'s report as it ends."""
    bench = bench or BenchmarkRun("official_bench")
    bench.plan(warmup + repeats)
    if model_name not in PRESETS:
        raise SystemExit(f"--model must be a preset ({', '.join(PRESETS)}); the official side reads its yaml")
    yaml_path = PRESETS_DIR / PRESETS[model_name]
    family = ModelConfig.from_yaml_file(yaml_path).family
    if family.llm_class != "TransformerLM":
        raise SystemExit(f"{model_name} is {family.name}: the official worker wires v1 only")
    if not (official / "cosyvoice").is_dir():
        raise SystemExit(f"--official {official}: not an official CosyVoice checkout (it has no cosyvoice/)")
    if not os.access(official_python, os.X_OK):
        raise SystemExit(f"--official-python {official_python}: no such python (a venv with the official deps)")
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    fp32, stages = load_variants(model_name)
    segments = fixed_length_segments(TextEncoderStage(fp32), audio_seconds)
    choice, reason = choice_for(dtype, fp32)
    reference = stages["float32"]
    with torch.inference_mode():
        tokens = reference.generate_tokens(segments)
        mel = reference.tokens_to_mel(segments, tokens)
        audio = sum(len(w) for w in reference.vocode(segments, mel)) / fp32.config.sample_rate
    [segment] = segments
    inputs = {
        "text": torch.randint(0, 50000, (1, segment.text_len), generator=torch.Generator().manual_seed(0)).int(),
        "speech_tokens": torch.as_tensor(tokens[0]).reshape(1, -1).int(),
        "mel": torch.as_tensor(mel[0]).float().reshape(1, fp32.config.mel_bins, -1),
        "embedding": torch.from_numpy(segment.flow_embedding).float().reshape(1, -1),
    }
    ours = {
        stage: {
            variant: getattr(stages[variant], method)
            for variant in dict.fromkeys(("float32", choice[stage]))  # in this order, once each
            for method in [{"llm": "generate_tokens", "flow": "tokens_to_mel", "hift": "vocode"}[stage]]
        }
        for stage in STAGES
    }
    stage_input = {"llm": (segments,), "flow": (segments, tokens), "hift": (segments, mel)}
    seconds: dict[str, dict[str, list[float]]] = {s: {v: [] for v in ("official", *ours[s])} for s in STAGES}
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(inputs, Path(tmp) / "inputs.pt")
        worker = OfficialWorker(official_python, official, yaml_path, Path(tmp) / "inputs.pt", threads)
        try:
            with torch.inference_mode():
                for round_ in range(warmup + repeats):
                    for stage in STAGES:
                        took = {"official": worker.time(stage)}
                        for variant, call in ours[stage].items():
                            started = time.perf_counter()
                            call(*stage_input[stage])
                            took[variant] = time.perf_counter() - started
                        if round_ >= warmup:
                            for variant, value in took.items():
                                seconds[stage][variant].append(value)
                    bench.step(f"round {round_ + 1}/{warmup + repeats}", seconds_samples=seconds)
        finally:
            worker.close()
    timings = {s: {v: Timing(tuple(x)) for v, x in per.items()} for s, per in seconds.items()}
    rtf: dict[str, Any] = {
        stage: speedup_fields({v: t.map(lambda s: s / audio) for v, t in per.items()}, "official", OVER_OFFICIAL)
        for stage, per in timings.items()
    }
    picks = {"official": dict.fromkeys(STAGES, "official"), "float32": dict.fromkeys(STAGES, "float32")}
    picks["choice"] = choice
    decoder = {
        name: paired(lambda *s: sum(s) / audio, *(timings[stage][pick[stage]] for stage in STAGES))
        for name, pick in picks.items()
    }
    rtf["decoder"] = speedup_fields(decoder, "official", OVER_OFFICIAL)
    n_tokens = inputs["speech_tokens"].shape[1]
    return report_settings(model_name, threads, repeats, warmup, dtype, choice, reason) | {
        "official_worker": worker.info,
        "official_sizes": worker.sizes,
        "audio_seconds": audio,
        "speech_tokens": n_tokens,
        "load_average_before_after": [load_before, os.getloadavg()],
        "rtf": rtf,
        "llm_ms_per_token": {v: 1000 * t.median / n_tokens for v, t in timings["llm"].items()},
        "seconds_samples": seconds,
    }


def main() -> None:
    parser = bench_parser(__doc__, "official_bench.json", 5.0, "audio length to generate")
    parser.add_argument("--official", type=Path, required=True, help="the official CosyVoice checkout")
    parser.add_argument("--official-python", required=True, help="the python of a venv with the official deps")
    parser.add_argument("--dtype", default="auto", help="our choice timed beside float32: auto or a dtype")
    args = parser.parse_args()
    bench = BenchmarkRun("official_bench", args.out)
    result = run(
        args.model,
        args.official,
        args.official_python,
        args.seconds,
        args.threads,
        args.repeats,
        args.warmup,
        args.dtype,
        bench,
    )
    bench.finish(result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
