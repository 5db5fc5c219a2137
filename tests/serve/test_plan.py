"""The plan for a machine (`serve_app.plan`), a pure function of the inventory, the model's sizes and the app args:
v1, v2 and v3 at their real sizes (built on the meta device: no weights) on an 8, 16, 24 and 80 GB card (the memory
nvidia-smi reports for an RTX 4060, an RTX 4060 Ti 16 GB, an A10G and an H100 80 GB), two GPUs and none; a card too
small; the args' own choices; a footprint the GPU check recorded in place of the estimate; the GPUs nvidia-smi lists (a
stand-in program) and `cosyvoice-serve plan`."""

from __future__ import annotations

import json
import os
import re
import stat
from functools import cache
from pathlib import Path

import pytest
import yaml

from engine.loading.loader import ModelSizes, model_sizes
from engine.nn.precision import CpuCapabilities
from engine.runtime.memory import estimate_request_memory, memory_budget_for
from engine.text.frontend import SEGMENT_MAX_LEN
from serve_app import cli, footprints
from serve_app.args import AppArgs
from serve_app.footprints import PlanError, recorded_footprints
from serve_app.inventory import Gpu, Inventory, gpus_from_nvidia_smi
from serve_app.plan import Plan, plan_for

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
GIB = 2**30
CARDS = {  # memory.total as nvidia-smi reports it, MiB
    8: Gpu("NVIDIA GeForce RTX 4060", 8188 * MIB, True),
    16: Gpu("NVIDIA GeForce RTX 4060 Ti", 16380 * MIB, True),
    24: Gpu("NVIDIA A10G", 23028 * MIB, True),
    80: Gpu("NVIDIA H100 80GB HBM3", 81559 * MIB, True),
}
MODELS = {"v1": "cosyvoice-300m", "v2": "cosyvoice2-0.5b", "v3": "cosyvoice3-0.5b"}
CPU = CpuCapabilities(frozenset({"avx2"}), "AVX2", "a test CPU")  # no native bfloat16: CPU auto keeps flow float32
BATCH = 4  # the article's dynamic batches of at most 4


@cache
def sizes_of(version: str) -> ModelSizes:
    return model_sizes(MODELS[version])


def machine(*gpus: Gpu, cpus: float = 16) -> Inventory:
    return Inventory(gpus=gpus, cpus=cpus, cpu=CPU)


def args_for(version: str, **decoder: object) -> AppArgs:
    return AppArgs.model_validate({"model": MODELS[version], "decoder": {"max_batch_size": BATCH, **decoder}})


def test_the_real_sizes_are_the_released_models() -> None:
    """Parameters of the real-size presets: CosyVoice-300M's ~300M LLM, the Qwen2-0.5B LLM of v2 and v3 (a 151936-row
    text table of 896 wide), v3's DiT flow three times v2's causal flow."""
    v1, v2, v3 = (sizes_of(version).parameters for version in ("v1", "v2", "v3"))
    assert 0.28e9 < v1["llm"] < 0.34e9
    assert 0.48e9 < v2["llm"] < 0.53e9 and 0.48e9 < v3["llm"] < 0.53e9
    assert 0.3e9 < v3["flow"] < 0.35e9 and 0.1e9 < v2["flow"] < 0.12e9
    assert all(0.015e9 < sizes["hift"] < 0.025e9 for sizes in (v1, v2, v3))


@pytest.mark.parametrize("version", MODELS)
@pytest.mark.parametrize("card_gb", CARDS)
def test_each_card_holds_the_replicas_it_is_given_and_no_more(version: str, card_gb: int) -> None:
    card = CARDS[card_gb]
    plan = plan_for(machine(card), sizes_of(version), args_for(version))
    memory = plan.memory
    assert plan.device == "cuda" and memory is not None and plan.max_batch_size == BATCH
    expected = (
        {"llm": "bfloat16", "flow": "bfloat16", "hift": "float16"}
        if version == "v3"
        else dict.fromkeys(("llm", "flow", "hift"), "float16")
    )
    assert plan.dtypes == expected
    itemsize = {"float16": 2, "bfloat16": 2}
    sizes = sizes_of(version).parameters
    assert memory.weights_bytes == sum(sizes[stage] * itemsize[plan.dtypes[stage]] for stage in sizes)

    n, share = plan.replicas_per_gpu, plan.gpu_fraction * card.memory_bytes
    assert n >= 1 and n * (share + memory.context_bytes) <= card.memory_bytes  # the card holds them
    assert (n + 1) * memory.total_bytes > card.memory_bytes  # and not one more
    # each replica's `auto` budget (what the decoder computes from its share) holds the loop's planned sentences
    budget = memory_budget_for(int(share), memory.weights_bytes)
    config = sizes_of(version).config
    longest = estimate_request_memory(config, SEGMENT_MAX_LEN, dtype_bytes=2, prompt_speech_tokens=0)
    assert budget >= memory.budget_bytes >= longest.total_bytes

    decoder = AppArgs.model_validate({"model": MODELS[version], "decoder": plan.decoder_args}).decoder
    assert decoder.num_gpus == plan.gpu_fraction
    if n == 1:
        assert decoder.autoscaling is None and plan.deployments == [{"name": "Decoder", "num_replicas": 1}]
    else:  # 1 to the card's count, on the decoder policy (its 70%/5 min up, 30%/20 min down rules)
        rules = decoder.autoscaling.rules
        assert (rules.min_replicas, rules.max_replicas) == (1, n) == (plan.min_replicas, plan.max_replicas)
        assert (rules.scale_up_utilization, rules.scale_up_window_s) == (0.7, 300)
        assert (rules.scale_down_utilization, rules.scale_down_window_s) == (0.3, 1200)


def test_bigger_cards_hold_more_replicas_and_two_gpus_twice_one() -> None:
    for version in MODELS:
        counts = [plan_for(machine(CARDS[gb]), sizes_of(version), args_for(version)).replicas_per_gpu for gb in CARDS]
        assert counts == sorted(counts) and counts[0] == 1 and counts[-1] > 4, (version, counts)
        one = plan_for(machine(CARDS[24]), sizes_of(version), args_for(version))
        two = plan_for(machine(CARDS[24], CARDS[24]), sizes_of(version), args_for(version))
        assert two.replicas_per_gpu == one.replicas_per_gpu and two.gpu_fraction == one.gpu_fraction
        assert two.max_replicas == 2 * one.replicas_per_gpu


def test_the_cpus_bound_the_replicas() -> None:
    """Each decoder replica takes decoder.num_cpus (0.5) beside the ingress's 0.25 and the encoder's 0.5: on 4 CPUs
    6 decoders fit, whatever the card holds."""
    plan = plan_for(machine(CARDS[80], cpus=4), sizes_of("v1"), args_for("v1"))
    assert plan.replicas_per_gpu == 6


def test_the_cpus_the_deployment_overrides_give_bound_the_replicas() -> None:
    """The ingress's and the encoders' CPUs are their deployments' options: 2 ingress replicas at 0.5 and an
    encoder floor of 2 at 0.5 take 2 of 4 CPUs, which leave 4 decoders at 0.5."""
    deployments = [
        {"name": "TTSIngress", "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}},
        {"name": "Encoder", "autoscaling_config": {"min_replicas": 2, "max_replicas": 4}},  # 0.5 CPU: the code's
    ]
    plan = plan_for(machine(CARDS[80], cpus=4), sizes_of("v1"), args_for("v1"), deployments=deployments)
    assert plan.replicas_per_gpu == 4
    assert plan.deployments == deployments  # nothing fixed: the decoders scale 1-4


def test_without_a_gpu_the_decoders_run_on_cpu() -> None:
    for version in MODELS:
        plan = plan_for(machine(), sizes_of(version), args_for(version))
        assert plan.device == "cpu" and plan.memory is None and plan.decoder_args["num_gpus"] == 0
        assert plan.dtypes == {"llm": "int8", "flow": "float32", "hift": "float32"}  # CPU auto on this CPU
    with pytest.raises(PlanError, match="--device cuda, but Ray sees no GPU"):
        plan_for(machine(), sizes_of("v3"), args_for("v3"), device="cuda")
    assert plan_for(machine(CARDS[24]), sizes_of("v3"), args_for("v3"), device="cpu").device == "cpu"


def test_auto_int4_plans_cpu_decoders_with_an_int4_llm_even_beside_a_gpu() -> None:
    plan = plan_for(machine(CARDS[24]), sizes_of("v1"), args_for("v1", dtype="auto-int4"))
    assert plan.device == "cpu" and plan.dtypes == {"llm": "int4", "flow": "float32", "hift": "float32"}
    with pytest.raises(PlanError, match="auto-int4 is for CPU decoders: run with --device cpu"):
        plan_for(machine(CARDS[24]), sizes_of("v1"), args_for("v1", dtype="auto-int4"), device="cuda")


def test_a_card_too_small_is_refused_with_the_numbers_and_the_cpu_choice() -> None:
    small = Gpu("a 4 GB card", 4 * 2**30, True)
    with pytest.raises(PlanError) as refused:
        plan_for(machine(small), sizes_of("v3"), args_for("v3"))
    message = str(refused.value)
    assert "4.00 GiB cannot hold one decoder replica of cosyvoice3-0.5b with batches of 4" in message
    assert "weights 1.60 GiB" in message and "--device cpu" in message and "lower decoder.max_batch_size" in message


def test_an_unpinned_batch_size_is_lowered_to_fit_one_replica() -> None:
    """The args' default batch (8) does not fit v3 on an 8 GB card; the plan takes the largest that does."""
    args = AppArgs(model=MODELS["v3"])
    plan = plan_for(machine(CARDS[8]), sizes_of("v3"), args)
    assert plan.replicas_per_gpu == 1 and 1 < plan.max_batch_size < args.decoder.max_batch_size
    assert plan.decoder_args["max_batch_size"] == plan.max_batch_size


def test_the_args_own_fraction_is_kept_or_refused_with_the_numbers() -> None:
    plan = plan_for(machine(CARDS[80]), sizes_of("v1"), args_for("v1", num_gpus=0.25))
    assert (plan.gpu_fraction, plan.replicas_per_gpu) == (0.25, 4)
    with pytest.raises(
        PlanError, match=r"decoder\.num_gpus 0\.25 gives a replica 2\.00 GiB of the GPU's 8\.00 GiB; it needs"
    ):
        plan_for(machine(CARDS[8]), sizes_of("v3"), args_for("v3", num_gpus=0.25))
    assert plan_for(machine(CARDS[24]), sizes_of("v3"), args_for("v3", num_gpus=0)).device == "cpu"


def test_float16_for_v3_on_a_card_without_native_bfloat16() -> None:
    turing = Gpu("NVIDIA T4", 15360 * MIB, False)
    plan = plan_for(machine(turing), sizes_of("v3"), args_for("v3"))
    assert plan.dtypes == {"llm": "float16", "flow": "float16", "hift": "float16"}


def test_the_args_autoscaling_rules_are_kept_within_the_machine() -> None:
    rules = {
        "max_replicas": 12,
        "schedule": {"timezone": "UTC", "windows": [{"name": "night", "start": "02:00", "end": "06:00"}]},
    }
    args = args_for("v2", autoscaling={"rules": rules})
    plan = plan_for(machine(CARDS[24]), sizes_of("v2"), args)
    kept = plan.decoder_args["autoscaling"]["rules"]
    assert kept["max_replicas"] == plan.replicas_per_gpu < 12 and kept["schedule"] == rules["schedule"]


def record(folder: Path, plan: Plan, peaks: list[int] | None) -> Path:
    """A plan_check report as benchmarks/plan_check.py writes it (the plan it ran, each replica's peak) in `folder`,
    with peaks the test makes up: a test's fixture, not a measurement."""
    folder.mkdir(exist_ok=True)
    path = folder / f"plan_check_{len(list(folder.iterdir()))}.json"
    report = {"model": plan.model, "complete": True, "plan": plan.to_json(), "per_replica_peak_bytes": peaks}
    path.write_text(json.dumps(report))
    return path


def test_a_recorded_peak_replaces_the_estimate_for_the_same_replica_on_a_card_of_that_name(tmp_path: Path) -> None:
    a10g = CARDS[24]
    estimated = plan_for(machine(a10g), sizes_of("v3"), args_for("v3"))
    assert estimated.memory is not None and estimated.memory.measured_bytes is None
    peak = estimated.memory.total_bytes * 3 // 2  # made up: half as much again as the estimate
    path = record(tmp_path, estimated, [peak - GIB, peak])  # the largest replica's counts
    recorded = recorded_footprints(tmp_path)

    plan = plan_for(machine(a10g), sizes_of("v3"), args_for("v3"), measured=recorded)
    assert plan.memory is not None and (plan.memory.total_bytes, plan.memory.measured_in) == (peak, str(path))
    assert plan.replicas_per_gpu == a10g.memory_bytes // peak == 2 < estimated.replicas_per_gpu
    assert f"{peak / GIB:.2f} GiB measured at its peak ({path}), in place of the estimate: weights" in plan.lines()[-2]
    assert plan.to_json()["memory"]["measured_bytes"] == peak
    # another card's name, another batch size, other dtypes: another replica, so the estimate
    other_card = Gpu("NVIDIA L4", a10g.memory_bytes, True)
    for args, card in ((args_for("v3"), other_card), (args_for("v3", max_batch_size=2), a10g)):
        assert plan_for(machine(card), sizes_of("v3"), args, measured=recorded).memory.measured_bytes is None
    in_float16 = plan_for(machine(a10g), sizes_of("v3"), args_for("v3", dtype="float16"), measured=recorded)
    assert in_float16.memory.measured_bytes is None


def test_a_record_that_is_no_gpu_measurement_is_refused_by_name(tmp_path: Path) -> None:
    on_cpu = plan_for(machine(), sizes_of("v1"), args_for("v1"))
    path = record(tmp_path, on_cpu, None)  # a plan_check run on CPU: nvidia-smi had nothing to show
    with pytest.raises(PlanError, match=rf"{re.escape(str(path))} is not a complete plan_check report of a GPU run"):
        recorded_footprints(tmp_path)
    path.write_text("{}")
    with pytest.raises(
        PlanError, match=rf"{re.escape(str(path))} is not a complete plan_check report .*KeyError: 'plan'"
    ):
        recorded_footprints(tmp_path)
    assert recorded_footprints(tmp_path / "none yet") == ()


def stand_in_nvidia_smi(folder: Path, rows: str) -> dict[str, str]:
    """A PATH whose `nvidia-smi` prints `rows` for any query, as the real one prints its CSV."""
    folder.mkdir(exist_ok=True)
    program = folder / "nvidia-smi"
    program.write_text(f"#!/bin/sh\ncat <<'EOF'\n{rows}\nEOF\n")
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


ROWS = "0, GPU-aaaa1111, NVIDIA A10G, 23028, 8.6\n1, GPU-bbbb2222, Tesla T4, 15360, 7.5"


def test_the_gpus_nvidia_smi_lists_as_cuda_visible_devices_names_them(tmp_path: Path) -> None:
    env = stand_in_nvidia_smi(tmp_path, ROWS)
    a10g, t4 = Gpu("NVIDIA A10G", 23028 * MIB, True), Gpu("Tesla T4", 15360 * MIB, False)
    assert gpus_from_nvidia_smi(env) == (a10g, t4)
    assert gpus_from_nvidia_smi(env | {"CUDA_VISIBLE_DEVICES": "1"}) == (t4,)
    assert gpus_from_nvidia_smi(env | {"CUDA_VISIBLE_DEVICES": "GPU-bbbb,0"}) == (t4, a10g)
    assert gpus_from_nvidia_smi(env | {"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert gpus_from_nvidia_smi({"PATH": str(tmp_path / "nowhere")}) == ()


def test_the_plan_command_on_this_machine_and_a_described_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in stand_in_nvidia_smi(tmp_path, ROWS.splitlines()[0]).items():
        monkeypatch.setenv(name, value)

    def plan(*args: str) -> tuple[int, str, str]:
        code = cli.main(["plan", "--model", "cosyvoice3-0.5b", "--cpus", "16", *args])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = plan("--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["inventory"]["gpus"] == [{"name": "NVIDIA A10G", "memory_bytes": 23028 * MIB, "native_bfloat16": True}]
    assert shown["device"] == "cuda" and shown["replicas_per_gpu"] >= 1

    code, out, err = plan("--gpus", "2", "--gpu-memory-gb", "80")
    assert code == 0, err
    assert "2 GPU(s): GPU 80.0 GiB, GPU 80.0 GiB" in out and "memory per decoder replica" in out
    code, out, _ = plan("--gpus", "0")
    assert code == 0 and "decoder: CPU" in out
    code, _, err = plan("--gpus", "1", "--gpu-memory-gb", "4")
    assert code == 2 and err.startswith("error: the GPU's 4.00 GiB cannot hold one decoder")

    # a footprint recorded for the card (a test's record, in place of docs/gpu_check/'s) is the one it takes
    a10g = Gpu("NVIDIA A10G", 24 * GIB, True)
    path = record(tmp_path / "recorded", plan_for(machine(a10g), sizes_of("v3"), AppArgs(model=MODELS["v3"])), [GIB])
    monkeypatch.setattr(footprints, "RECORDED_DIR", path.parent)
    code, out, err = plan("--gpus", "1", "--gpu-memory-gb", "24", "--gpu-name", a10g.name)
    assert code == 0 and f"1.00 GiB measured at its peak ({path})" in out, err
    path.write_text("[]")
    code, _, err = plan("--gpus", "1", "--gpu-memory-gb", "24", "--gpu-name", a10g.name)
    assert code == 2 and err.startswith(f"error: {path} is not a complete plan_check report")


def test_the_single_gpu_profile_on_an_8_gb_card_and_a_larger_one() -> None:
    """configs/single_gpu.yaml: the article's settings (batches of at most 4, the 70%/5 min and 30%/20 min rules, the
    night on the CPU fallback) kept; the card decides the GPU fraction and how many replicas."""
    (application,) = yaml.safe_load((ROOT / "configs" / "single_gpu.yaml").read_text())["applications"]
    args = AppArgs.model_validate(application["args"] | {"model": MODELS["v3"]})
    small = plan_for(machine(CARDS[8], cpus=8), sizes_of("v3"), args)
    assert (small.replicas_per_gpu, small.max_batch_size, small.max_replicas) == (1, BATCH, 1)
    assert small.windows == ("night 02:00-06:00 UTC: min 0 (the CPU fallback decoder serves at 0)",)
    rules = AppArgs.model_validate(application["args"] | {"decoder": small.decoder_args}).decoder.autoscaling.rules
    assert (rules.scale_up_utilization, rules.scale_up_window_s) == (0.7, 300)
    assert (rules.scale_down_utilization, rules.scale_down_window_s) == (0.3, 1200)
    large = plan_for(machine(CARDS[24], cpus=8), sizes_of("v3"), args)
    assert large.replicas_per_gpu == large.max_replicas > 1 and large.gpu_fraction < small.gpu_fraction


def test_an_explicit_memory_budget_is_the_loops_as_the_decoder_reads_it() -> None:
    plan = plan_for(machine(CARDS[24]), sizes_of("v1"), args_for("v1", memory_budget_gb=2.0))
    assert plan.memory is not None and plan.memory.budget_bytes == 2 * 2**30
    assert memory_budget_for(int(plan.gpu_fraction * CARDS[24].memory_bytes), plan.memory.weights_bytes) >= 2 * 2**30
