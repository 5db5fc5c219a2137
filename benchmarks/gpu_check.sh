#!/usr/bin/env bash
# The GPU check, prepared to run in under 10 minutes on one GPU machine (every figure the median of 3 repeats):
#   1. the engine on CUDA in fp16 with the real-size dummy model (benchmarks.gpu_check): finite outputs,
#      peak memory, RTF at batch 1, 4 and 16, first-chunk time of a 20 s utterance;
#   2. benchmarks.compare at 1, 4 and 16 clients on a local Serve whose decoder replica has a GPU fraction (its
#      `decoder_replica` stats: the `auto` memory budget against the peak device memory under load);
#   3. benchmarks.streams on such a Serve, once per decoder policy (fcfs, deadline): Poisson streams at 3 rates,
#      6 each, and the 7 long + 1 late short scenario twice (the idle time to first audio 3 times), its long
#      texts 2 sentences instead of the issue's 8 to fit the step's time.
# Everything lands in OUT_DIR (default out/gpu_check): engine.json, compare.json/.png, streams.json/.png,
# gpu_check.json.
#
#   benchmarks/gpu_check.sh [OUT_DIR]
#   benchmarks/gpu_check.sh --cpu [OUT_DIR]   # the same steps on CPU with the tiny model (no GPU needed)
set -euo pipefail

device=cuda model=dummy num_gpus=0.5
if [[ "${1:-}" == "--cpu" ]]; then
  device=cpu model=tiny num_gpus=0
  shift
fi
out=${1:-out/gpu_check}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

if [[ "$device" == cuda ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/nvidia_smi.csv"
fi

# Each step has its own time limit so that the whole stays under 10 minutes; a step that fails is recorded.
status=0
timeout 120 python -m benchmarks.gpu_check --device "$device" --model "$model" --out "$out/engine.json" \
  2>&1 | tee "$out/engine.log" || status=1
timeout 300 python -m benchmarks.compare --model "$model" --device "$device" --num-gpus "$num_gpus" \
  --clients 1 4 16 --requests 8 --rates 2 --out "$out/compare.json" 2>&1 | tee "$out/compare.log" || status=1
timeout 150 python -m benchmarks.streams --model "$model" --num-gpus "$num_gpus" --rates 0.5 1 2 --arrivals 6 \
  --long-sentences 2 --repeats 2 --drain-timeout-s 30 --out "$out/streams.json" 2>&1 | tee "$out/streams.log" || status=1

python - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
merged = {}
for name in ("engine", "compare", "streams"):
    path = out / f"{name}.json"
    merged[name] = json.loads(path.read_text()) if path.exists() else None
if merged["compare"] is not None:  # the per-request lists stay in compare.json
    merged["compare"] = {k: v for k, v in merged["compare"].items() if k not in ("ray_serve", "baseline")}
if merged["streams"] is not None:  # the per-stream lists stay in streams.json
    merged["streams"] = {k: v for k, v in merged["streams"].items() if k != "policies"}
(out / "gpu_check.json").write_text(json.dumps(merged, indent=2))
print(f"wrote {out / 'gpu_check.json'}")
PY
exit $status
