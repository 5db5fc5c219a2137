#!/usr/bin/env bash
# The first check on a GPU machine that holds nothing but this repository and a CUDA build of torch, in under 10 min:
#
#   bash benchmarks/gpu_check.sh [--cpu] [--quick] [--wheels DIR] [OUTDIR]     # OUTDIR: default $OUT
#
#   0. preflight: python >= 3.10, torch imports, is a CUDA build, sees a device, with enough free memory; else a
#      message and exit 3-7 (preflight.json says which), before anything is installed;
#   1. install (not with --cpu), only when the parts' modules do not import: `pip install -e .[test]` under a constraint that pins
#      the torch (and torchaudio, torchvision) already there, so pip keeps the machine's CUDA torch or fails, and
#      never fetches another torch (a plain install could replace it with PyPI's default build; `--no-deps` would
#      leave ray, httpx and the others out). `--wheels DIR` (or GPU_CHECK_WHEELS) installs from wheels in DIR only,
#      for a machine without network. A failed install is recorded; the parts whose modules import still run;
#   2. precision (benchmarks.gpu_check): finite outputs and cosine to float32 of float16, bfloat16 and `auto` per
#      stage (LLM, flow, vocoder) and family (v1, v2, v3 at real sizes, dummy weights; v3's LLM in bf16 and fp32);
#   3. engine: RTF at batch 1, 4 and 16 and peak memory of the fp16 decoder, first-chunk time of a 20 s utterance;
#   4. replica: one decoder replica in process at GPU fraction 0.25 (every profile's), its `auto` memory budget, the
#      decoder loop (two lanes, each on its CUDA stream) under 16 mixed requests: peak memory against budget and
#      cap, NVML readings meanwhile;
#   4b. sharing: decoder replicas as processes on one GPU, 1 at the whole GPU, 4 at 0.25 time-sliced, 4 at 0.25
#      under an MPS daemon of its own (docs/gpu_sharing.md), the same open-loop streaming load at 1, 4 and 16
#      clients: requests/s, audio s/s, first-audio p50/p95, peak memory per replica against its cap,
#      `mps_throughput_ratio` (also at the top of gpu_check.json, with `per_replica_peak_gb`);
#   5. streams (benchmarks.streams, Ray Serve, decoder at num_gpus 0.25): Poisson streams at 2 rates, both policies;
#   6. compare (benchmarks.compare, Ray Serve at 0.25): closed loops of 1, 4 and 16 clients against the baseline;
#   7. plan_check (benchmarks.plan_check): `cosyvoice-serve run --model cosyvoice3-0.5b` (the real-size v3, dummy
#      weights) as the reader runs it, its printed plan against the plan for this card, the GPU processes nvidia-smi
#      shows against the plan's replicas, 8 streamed requests 4 at a time: first audio, each replica's peak memory
#      against the plan's footprint per replica.
# Each part has its own time limit, cut to what is left of GPU_CHECK_TOTAL_S (default 555 s), so a slow part still
# leaves the others' results; a part writes its JSON as it goes. Everything lands in OUTDIR: <part>.json and
# <part>.log, nvidia_smi_*.csv, and gpu_check.json (all parts merged, with each part's status). Exit 0 when every
# part ran to its end, 1 when one failed or ran out of time, 2 for a usage error, 3-7 for a failed preflight.
#
# --cpu: the same steps on CPU with the tiny models (no GPU needed; never installs: a missing module is reported).
# --quick: smaller inputs, one repeat, and the two Ray Serve parts only check their arguments (`--dry-run`); with
# --cpu it is the suite's test of this script (tests/benchmarks/test_gpu_check.py).
set -uo pipefail # no -e: a failed part is recorded and the next one runs

usage() { sed -n '2,4p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

device=cuda quick=0 wheels=${GPU_CHECK_WHEELS:-} out=""
while (($#)); do
  case "$1" in
    --cpu) device=cpu ;;
    --quick) quick=1 ;;
    --wheels)
      [[ $# -ge 2 ]] || { echo "gpu_check: --wheels needs a folder" >&2; exit 2; }
      wheels=$2
      shift
      ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "gpu_check: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) out=$1 ;;
  esac
  shift
done
out=${out:-${OUT:-}}
if [[ -z "$out" ]]; then
  echo "gpu_check: give the output folder as the last argument (or set OUT)" >&2
  exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$out" && out=$(cd "$out" && pwd) # absolute before the cd below
cd "$repo" || exit 2
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

python=${PYTHON:-}
for candidate in python3 python; do
  [[ -n "$python" ]] && break
  command -v "$candidate" > /dev/null && python=$candidate
done
if [[ -z "$python" ]]; then
  echo "gpu_check preflight: no python3 or python on PATH" >&2
  exit 3
fi

total_s=${GPU_CHECK_TOTAL_S:-555}
start=$SECONDS
status=0
: > "$out/parts.tsv"
record() { # NAME STATUS
  printf '%s\t%s\n' "$1" "$2" >> "$out/parts.tsv"
  echo "-- $1: $2"
}

# run_part NAME LIMIT_S COMMAND...: the command under `timeout`, cut to the time left; its output to NAME.log
run_part() {
  local name=$1 box=$2
  shift 2
  local left=$((total_s - (SECONDS - start)))
  local limit=$((box < left ? box : left))
  if ((limit < 10)); then
    record "$name" "skipped: ${left}s left of ${total_s}s"
    status=1
    return
  fi
  echo "== $name (at most ${limit}s, $((SECONDS - start))s so far)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  case $rc in
    0) record "$name" ok ;;
    124 | 137) record "$name" "timed out after ${limit}s"; status=1 ;;
    *) record "$name" "failed (exit $rc)"; status=1 ;;
  esac
}

merge() {
  "$python" - "$out" "$device" "$quick" "$((SECONDS - start))" <<'PY'
import csv, json, sys
from pathlib import Path

out, device, quick, elapsed = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
parts = dict(line.split("\t", 1) for line in (out / "parts.tsv").read_text().splitlines() if "\t" in line)
merged = {"device": device, "quick": quick, "elapsed_s": elapsed, "parts": parts}
for name in ("preflight", "install", "precision", "engine", "replica", "sharing", "streams", "compare", "plan_check"):
    path = out / f"{name}.json"
    try:
        merged[name] = json.loads(path.read_text()) if path.exists() else None
    except ValueError as exc:  # a part cut mid-write
        merged[name] = {"unreadable": str(exc)}
if isinstance(merged["compare"], dict):  # the per-request lists stay in compare.json
    merged["compare"] = {k: v for k, v in merged["compare"].items() if k not in ("ray_serve", "baseline")}
if isinstance(merged["sharing"], dict):  # its headline keys at the top
    for key in ("mps_throughput_ratio", "per_replica_peak_gb"):
        merged[key] = merged["sharing"].get(key)
if isinstance(merged["streams"], dict):  # the per-stream lists stay in streams.json
    merged["streams"] = {k: v for k, v in merged["streams"].items() if k != "policies"}
for when in ("before", "after"):
    path = out / f"nvidia_smi_{when}.csv"
    merged[f"nvidia_smi_{when}"] = list(csv.DictReader(path.open())) if path.exists() else None
(out / "gpu_check.json").write_text(json.dumps(merged, indent=2))
print(f"wrote {out / 'gpu_check.json'}")
PY
}

nvidia_smi() { # WHEN
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,utilization.gpu,power.draw,temperature.gpu,driver_version \
      --format=csv,nounits > "$out/nvidia_smi_$1.csv" 2>&1 || true
  fi
}

# --- 0. preflight -------------------------------------------------------------------------------------------------
echo "== preflight ($device)"
"$python" - "$device" "$out/preflight.json" <<'PY'
import json, platform, sys

device, path = sys.argv[1], sys.argv[2]
report = {"device": device, "python": platform.python_version(), "executable": sys.executable}
MIN_FREE_GIB = 6  # precision: a 0.5B model in fp32 and a cast copy; replica: a quarter card


def finish(code: int, message: str | None = None) -> None:
    report["ok"] = code == 0
    if message:
        report["error"] = message
        print(f"gpu_check preflight: {message}", file=sys.stderr)
    with open(path, "w") as file:
        json.dump(report, file, indent=2)
    print(json.dumps(report))
    sys.exit(code)


if sys.version_info < (3, 10):
    finish(3, f"python {platform.python_version()} is too old: the project needs 3.10 or later")
try:
    import torch
except Exception as exc:
    finish(4, f"torch does not import ({type(exc).__name__}: {exc}): install a CUDA build of torch first")
report.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
if device == "cuda":
    if torch.version.cuda is None:
        finish(5, f"torch {torch.__version__} is a CPU-only build: install a CUDA build (this script never replaces it)")
    if not torch.cuda.is_available():
        finish(6, "torch sees no CUDA device (is the driver there, CUDA_VISIBLE_DEVICES set?)")
    free, total = torch.cuda.mem_get_info()
    report.update(
        device_name=torch.cuda.get_device_name(),
        device_count=torch.cuda.device_count(),
        capability=".".join(map(str, torch.cuda.get_device_capability())),
        bf16_native=torch.cuda.is_bf16_supported(including_emulation=False),
        memory_total_gib=round(total / 2**30, 2),
        memory_free_gib=round(free / 2**30, 2),
    )
    if free < MIN_FREE_GIB * 2**30:
        finish(7, f"{free / 2**30:.1f} GiB free on the GPU; the check needs about {MIN_FREE_GIB} GiB")
finish(0)
PY
rc=$?
if ((rc != 0)); then
  record preflight "failed (exit $rc)"
  merge
  exit "$rc"
fi
record preflight ok
nvidia_smi before

# --- 1. install, only what is missing -----------------------------------------------------------------------------
missing() { # sets engine_missing and serve_missing: the first import error of each group's modules, empty if none
  local lines
  lines=$("$python" - "$device" 2> /dev/null <<'PY'
import importlib, sys

groups = {"engine": ["benchmarks.gpu_check"], "serve": ["benchmarks.compare", "benchmarks.streams"], "nvml": []}
if sys.argv[1] == "cuda":
    groups["nvml"].append("pynvml")  # the `gpu` extra: the replica part's NVML readings (it runs without them)
for modules in groups.values():
    error = "ok"
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            error = f"{name}: {type(exc).__name__}: {exc}".splitlines()[0]
            break
    print(error)
PY
  )
  engine_missing=$(sed -n 1p <<< "$lines")
  serve_missing=$(sed -n 2p <<< "$lines")
  nvml_missing=$(sed -n 3p <<< "$lines")
  [[ -n "$engine_missing" ]] || engine_missing="the import check did not run"
  [[ -n "$serve_missing" ]] || serve_missing="the import check did not run"
  [[ "$engine_missing" == ok ]] && engine_missing=""
  [[ "$serve_missing" == ok ]] && serve_missing=""
  [[ "$nvml_missing" == ok ]] && nvml_missing=""
  return 0
}
missing
if [[ -z "$engine_missing$serve_missing$nvml_missing" ]]; then
  record install "not needed: every part's modules import"
  echo '{"needed": false}' > "$out/install.json"
elif [[ "$device" == cpu || -n "${GPU_CHECK_NO_INSTALL:-}" ]]; then # never into a developer's or CI's environment
  record install "skipped (--cpu or GPU_CHECK_NO_INSTALL): $engine_missing${serve_missing:+; $serve_missing}${nvml_missing:+; $nvml_missing}"
  echo '{"needed": true, "skipped": true}' > "$out/install.json"
  status=1
else
  before="$engine_missing${serve_missing:+; $serve_missing}${nvml_missing:+; $nvml_missing}"
  echo "missing: $before"
  "$python" - "$out/constraints.txt" <<'PY'
import sys
from importlib import metadata

pins = []
for name in ("torch", "torchaudio", "torchvision"):
    try:
        pins.append(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        continue
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
PY
  pip_args=(-m pip install --retries 1 --timeout 20 --constraint "$out/constraints.txt")
  # a recent setuptools here builds the editable install without fetching one (no network needed for it)
  if "$python" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)" 2> /dev/null; then
    pip_args+=(--no-build-isolation)
  fi
  [[ -n "$wheels" ]] && pip_args+=(--no-index --find-links "$wheels")
  run_part install 120 "$python" "${pip_args[@]}" -e ".[test,gpu]"
  missing
  if [[ -n "$engine_missing$nvml_missing" ]]; then # no Ray to be had (offline, say): the in-process parts' needs alone
    run_part install_engine 60 "$python" "${pip_args[@]}" numpy pyyaml tokenizers tiktoken inflect nvidia-ml-py
    missing
  fi
  "$python" -c "import json, sys; json.dump({'needed': True, 'missing_before': sys.argv[1], 'missing_after': sys.argv[2] or None, 'constraints': open(sys.argv[3]).read().split()}, open(sys.argv[4], 'w'), indent=2)" \
    "$before" "$engine_missing${serve_missing:+; $serve_missing}${nvml_missing:+; $nvml_missing}" "$out/constraints.txt" \
    "$out/install.json"
fi

# --- 2-4. the engine in process -----------------------------------------------------------------------------------
if [[ "$device" == cuda ]]; then
  model=dummy num_gpus=0.25 planned_model=cosyvoice3-0.5b
else
  model=tiny num_gpus=0 planned_model=tiny
fi
check=("$python" -m benchmarks.gpu_check --device "$device")
if ((quick)); then
  precision_args=(--seconds 0.25 --families v3 v1)
  engine_args=(--seconds 0.25 --stream-seconds 0.5 --repeats 1 --warmup 0)
  replica_args=(--requests 4 --loop-timeout-s 30)
  sharing_args=(--replicas 2 --clients 1 2 --period-s 0.5 --duration-s 0.5)
  plan_check_args=(--requests 2 --concurrency 2)
else
  precision_args=() engine_args=() replica_args=() sharing_args=() plan_check_args=()
fi
if [[ -z "$engine_missing" ]]; then
  run_part precision 100 "${check[@]}" --part precision --out "$out/precision.json" "${precision_args[@]}"
  run_part engine 60 "${check[@]}" --part engine --model "$model" --out "$out/engine.json" "${engine_args[@]}"
  run_part replica 50 "${check[@]}" --part replica --model "$model" --fraction 0.25 --out "$out/replica.json" \
    "${replica_args[@]}"
  run_part sharing 150 "${check[@]}" --part sharing --model "$model" --fraction 0.25 --out "$out/sharing.json" \
    "${sharing_args[@]}"
else
  for part in precision engine replica sharing; do record "$part" "skipped: $engine_missing"; done
  status=1
fi

# --- 5-6. Ray Serve at a 0.25 GPU fraction --------------------------------------------------------------------------
serve_dry=()
((quick)) && serve_dry=(--dry-run)
if [[ -z "$serve_missing" ]]; then
  run_part streams 70 "$python" -m benchmarks.streams --model "$model" --num-gpus "$num_gpus" --rates 1 2 \
    --arrivals 4 --long-sentences 1 --repeats 1 --warmup 0 --drain-timeout-s 20 --out "$out/streams.json" \
    "${serve_dry[@]}"
  run_part compare 90 "$python" -m benchmarks.compare --model "$model" --device "$device" --num-gpus "$num_gpus" \
    --clients 1 4 16 --requests 4 --rates 2 --repeats 1 --warmup 0 --out "$out/compare.json" "${serve_dry[@]}"
  run_part plan_check 120 "$python" -m benchmarks.plan_check --model "$planned_model" --device "$device" \
    --out "$out/plan_check.json" "${plan_check_args[@]}"
else
  for part in streams compare plan_check; do record "$part" "skipped: $serve_missing"; done
  status=1
fi

nvidia_smi after
merge
echo "gpu_check: $((SECONDS - start))s, exit $status"
exit $status
