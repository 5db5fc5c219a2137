"""`benchmarks/gpu_check.sh`, the first check of a GPU machine, run here as its `--cpu --quick` dry run: the same
script and parts on CPU with the tiny models (the two Ray Serve parts only check their arguments), so the script
cannot rot before a GPU runs it; and its preflight refusing a machine without a CUDA device, and a missing output
folder. No timing is asserted: this machine is shared."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STAGES = ("llm", "flow", "hift")


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "GPU_CHECK_TOTAL_S": "600", **(env or {})}  # no part cut short by a busy machine
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
@pytest.mark.serve  # its plan_check part starts `cosyvoice-serve run`
def test_the_cpu_dry_run_runs_every_part_and_merges_their_json(tmp_path: Path) -> None:
    out = tmp_path / "check"
    result = _run("--cpu", "--quick", str(out))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    merged = json.loads((out / "gpu_check.json").read_text())
    assert merged["device"] == "cpu" and merged["quick"] is True
    parts = merged["parts"]
    assert parts.pop("install").startswith("not needed")
    ran = ("preflight", "precision", "engine", "replica", "sharing", "streams", "compare", "plan_check")
    assert parts == dict.fromkeys(ran, "ok")
    assert merged["preflight"]["ok"] and merged["preflight"]["torch"] == torch.__version__

    precision = merged["precision"]
    assert precision["complete"] and precision["all_finite"]
    assert set(precision["families"]) == {"v1", "v3"}  # --quick; the full check adds v2
    for family in precision["families"].values():
        assert family["float32_finite"] and family["tokens"] > 0
        for dtype in ("float16", "bfloat16", "auto"):
            for stage in STAGES:
                row = family[dtype][stage]
                assert row["finite"] and row["cosine"] > 0.99, (dtype, stage, row)
        assert family["bfloat16"]["llm"]["dtype"] == "torch.bfloat16"
        assert family["auto"]["llm"]["dtype"] == "torch.float32"  # auto on CPU is float32
        assert 0 <= family["float16"]["llm"]["top1_agreement"] <= 1

    engine = merged["engine"]
    assert engine["complete"] and engine["all_finite"]
    assert [row["batch"] for row in engine["batches"]] == [1, 4, 16]
    assert all(engine[f"rtf_b{batch}"] > 0 for batch in (1, 4, 16))
    assert engine["first_chunk_s_0.5s"] > 0

    replica = merged["replica"]
    assert replica["complete"] and replica["all_ended"] and replica["all_finite"]
    assert not replica["request_errors"] and not replica["loop_errors"]
    # CPU: the budget is what the container (else the host) leaves, which the replica's own loop must fit in
    assert replica["memory_budget_bytes"] > 0 and replica["gpu_fraction"] is None
    assert "unavailable" in replica["nvml"] or replica["nvml"]["samples"] > 0

    sharing = merged["sharing"]  # 2 replicas and 2 load levels here (--quick); no MPS without CUDA
    assert sharing["complete"] and sharing["requests_lost"] == 0
    assert set(sharing["configs"]) == {"1x1.0", "2x0.25"} and sharing["mps_skipped"] == "MPS needs CUDA"
    for config in sharing["configs"].values():
        for level in config["levels"].values():
            assert level["completed"] == level["requests"] and level["audio_s_per_s"] > 0 and level["ttfa_p50_s"] > 0
    assert sharing["configs"]["2x0.25"]["levels"]["2"]["requests"] == 2
    assert merged["mps_throughput_ratio"] is None  # the headline keys, lifted from sharing.json
    assert merged["per_replica_peak_gb"] == {"1x1.0": [None], "2x0.25": [None, None]}  # CPU: no device memory

    for part in ("streams", "compare"):
        assert merged[part]["dry_run"] and merged[part]["num_gpus"] == 0, part

    # `cosyvoice-serve run` as the reader starts it: on CPU its plan puts the decoders there, nvidia-smi shows nothing
    plan_check = merged["plan_check"]
    assert plan_check["complete"] and plan_check["printed_plan_matches"] and plan_check["server_exit"] == 0
    assert plan_check["plan"]["device"] == "cpu" and plan_check["plan"]["decoder_args"]["num_gpus"] == 0
    assert len(plan_check["first_audio_s"]) == 2 and all(wait > 0 for wait in plan_check["first_audio_s"])
    assert plan_check["per_replica_peak_bytes"] is None and plan_check["within_plan"] is None
    for name in ("precision", "engine", "replica", "sharing", "streams", "compare", "plan_check"):
        assert (out / f"{name}.log").exists(), name


def test_the_gpu_run_uses_every_profiles_quarter_gpu() -> None:
    script = SCRIPT.read_text()
    assert "model=dummy num_gpus=0.25" in script
    assert "--fraction 0.25" in script
    assert "sharing_args=()" in script  # the GPU run: the part's defaults, 4 replicas at 1, 4 and 16 clients
    assert "planned_model=cosyvoice3-0.5b" in script  # the plan check: the real-size v3 as `run` serves it
    assert "--num-gpus 0.5" not in script and "num_gpus=0.5" not in script


def test_without_a_cuda_device_the_preflight_stops_with_its_reason(tmp_path: Path) -> None:
    if torch.cuda.is_available():  # pragma: no cover - a GPU machine runs the real check instead
        return
    out = tmp_path / "check"
    result = _run(str(out), env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    expected = 6 if torch.version.cuda else 5  # a CUDA build that sees no device, or a CPU-only build
    assert result.returncode == expected, result.stdout + result.stderr
    assert "gpu_check preflight:" in result.stderr
    preflight = json.loads((out / "preflight.json").read_text())
    assert preflight["ok"] is False and preflight["error"]
    merged = json.loads((out / "gpu_check.json").read_text())
    assert merged["parts"] == {"preflight": f"failed (exit {expected})"}


def test_an_output_folder_is_required(tmp_path: Path) -> None:
    environment = {k: v for k, v in os.environ.items() if k != "OUT"}
    result = subprocess.run(
        ["bash", str(SCRIPT), "--cpu"], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "output folder" in result.stderr
