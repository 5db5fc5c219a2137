"""The plan for the machine `cosyvoice-serve run` serves on: what runs where, how many decoder replicas share each
GPU and at which fraction, their dtypes and memory, and the decoders' autoscaling range.

`plan_for` is a pure function of the inventory (the GPUs and CPUs Ray sees), the model's sizes
(`engine.loading.loader.model_sizes`), the app args and the Serve config's `deployments:` overrides (the CPUs the
ingress and the encoders take are their deployments' options: `serve_app.deployment_options`). The ingress and the
encoders run on CPU. With a GPU the decoders go on it (`decoder.dtype` auto: float16, CosyVoice3 bfloat16 where the
card has it natively), as many per card as its memory holds replicas of the model's footprint (`DecoderMemory`: the
weights in those dtypes, the loop's memory budget for `decoder.max_batch_size` live sentences and its reserve, which
the replica's allocator share must hold, and the CUDA context outside it) and the CPUs leave room for, scaled between
1 and that count on the decoder policy (`autoscaling.policy`), or fixed at 1 (the `Decoder`'s num_replicas override)
where only one fits. A card too small for one replica is a `PlanError` with the numbers and the CPU choice.
`decoder.num_gpus` set in the args is kept (and checked); `device` cpu or cuda overrides the choice.

A footprint measured on a card (`serve_app.footprints`) replaces that estimate where one matches; the plan says which
it used. The inventory comes from `serve_app.inventory`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from engine.loading.loader import ModelSizes
from engine.nn.precision import (
    AUTO_DTYPE,
    AUTO_INT4_DTYPE,
    DecoderDtypes,
    cpu_auto_choice,
    gpu_auto_dtypes,
    parse_dtype,
)
from engine.runtime.memory import (
    CUDA_CONTEXT_BYTES,
    PLANNED_PROMPT_S,
    PLANNED_SPEECH_S,
    planned_budget_bytes,
    share_for_budget,
)
from serve_app.args import AppArgs
from serve_app.decoder_args import DecoderArgs
from serve_app.deployment_options import (
    DEFAULT_OPTIONS,
    DEPLOYMENT_NAMES,
    ENCODER,
    INGRESS,
    effective_options,
    parse_overrides,
    replica_floor,
    replica_num_cpus,
    with_options,
)
from serve_app.footprints import DecoderMemory, MeasuredFootprint, PlanError
from serve_app.inventory import GIB, Gpu, Inventory
from serve_app.routing import GPU_DECODER

Device = Literal["auto", "cpu", "cuda"]
GPU_FRACTION_STEPS = 10_000  # Ray keeps fractional resources to 1e-4


@dataclass(frozen=True)
class Plan:
    model: str
    inventory: Inventory
    device: Literal["cpu", "cuda"]
    dtypes: dict[str, str]  # each decoder module's precision (DecoderDtypes.describe)
    dtype_reason: str
    replicas_per_gpu: int  # 0 on CPU
    gpu_fraction: float  # each GPU replica's num_gpus; 0 on CPU
    memory: DecoderMemory | None  # None on CPU
    max_batch_size: int
    decoder_args: dict[str, Any]  # the app args' `decoder` section that runs it
    deployments: list[dict[str, Any]]  # the Serve config's `deployments:` overrides that run it
    min_replicas: int
    max_replicas: int
    windows: tuple[str, ...]  # the autoscaling schedule's windows, in words

    def lines(self) -> list[str]:
        """The plan as `run` and `plan` print it."""
        scaling = (
            f"{self.min_replicas}-{self.max_replicas} replicas, on GPU utilization and queue (autoscaling.policy)"
            if self.max_replicas > self.min_replicas
            else f"{self.max_replicas} replica(s)"
        )
        dtypes = ", ".join(f"{stage} {dtype}" for stage, dtype in self.dtypes.items())
        where = (
            f"GPU, {self.replicas_per_gpu} per card at num_gpus {self.gpu_fraction:g}"
            if self.device == "cuda"
            else "CPU"
        )
        lines = [
            f"plan for {self.model} on {self.inventory.describe()}:",
            "  ingress and encoder: CPU",
            f"  decoder: {where}; {dtypes} ({self.dtype_reason}); batches of at most {self.max_batch_size}",
            f"  decoder replicas: {scaling}",
            *(f"    {window}" for window in self.windows),
        ]
        if self.memory is not None:
            lines.append(f"  memory per decoder replica: {self.memory.describe()}")
            lines.append(
                f"    (the loop's budget holds {self.max_batch_size} live sentences of ~{PLANNED_SPEECH_S:g} s of "
                f"speech with a {PLANNED_PROMPT_S:g} s voice prompt, or one of the longest a sentence may make; more "
                "of shorter ones)"
            )
        return lines

    def to_json(self) -> dict[str, Any]:
        values = asdict(self)
        values["inventory"]["cpu"] = self.inventory.cpu.describe()
        if self.memory is not None:
            values["memory"] |= {
                "reserve_bytes": self.memory.reserve_bytes,
                "estimated_bytes": self.memory.estimated_bytes,
                "total_bytes": self.memory.total_bytes,
            }
        return values


def plan_for(
    inventory: Inventory,
    sizes: ModelSizes,
    args: AppArgs,
    device: Device = "auto",
    measured: Sequence[MeasuredFootprint] = (),
    deployments: Sequence[Mapping[str, Any]] = (),
) -> Plan:
    """Where the app runs on `inventory`, with the footprints `measured` on cards where one matches and the Serve
    config's `deployments` overrides (see the module docstring). PlanError where it cannot."""
    decoder = args.decoder
    overrides = parse_overrides(deployments, DEPLOYMENT_NAMES)
    pinned_fraction = decoder.num_gpus if "num_gpus" in decoder.model_fields_set else None
    cpu_only_dtype = decoder.dtype == AUTO_INT4_DTYPE  # torch's int4 kernel is a CPU one
    gpu_by_default = bool(inventory.gpus) and pinned_fraction != 0 and not cpu_only_dtype
    on_gpu = device == "cuda" or (device == "auto" and gpu_by_default)
    if on_gpu and not inventory.gpus:
        raise PlanError("--device cuda, but Ray sees no GPU on this machine; run with --device cpu")
    if on_gpu and cpu_only_dtype:
        raise PlanError(f"decoder.dtype {AUTO_INT4_DTYPE} is for CPU decoders: run with --device cpu, or use auto")
    if not on_gpu:
        return _cpu_plan(inventory, sizes, args, deployments)
    if pinned_fraction == 0:
        raise PlanError("--device cuda, but the app args pin decoder.num_gpus to 0")
    native_bfloat16 = all(gpu.native_bfloat16 for gpu in inventory.gpus)
    dtypes = _dtypes(decoder.dtype, lambda: gpu_auto_dtypes(sizes.config.family.prefers_bfloat16, native_bfloat16))
    smallest = min(inventory.gpus, key=lambda gpu: gpu.memory_bytes)
    card = smallest.memory_bytes
    # The args' batch size where they set it, else the largest up to the default that one replica fits on the card
    batch_sizes = [decoder.max_batch_size] if "max_batch_size" in decoder.model_fields_set else None
    for batch in batch_sizes or range(decoder.max_batch_size, 0, -1):
        memory = _with_measurement(_decoder_memory(sizes, dtypes, args, batch), smallest, dtypes, batch, measured)
        if memory.total_bytes <= card:
            break
    else:
        cpu = cpu_auto_choice(inventory.cpu, sizes.gemm).describe()
        lower = f"or lower decoder.max_batch_size ({batch})" if batch > 1 else "or a GPU with more memory"
        raise PlanError(
            f"the GPU's {card / GIB:.2f} GiB cannot hold one decoder replica of {args.model} with batches of {batch}: "
            f"{memory.describe()}; serve it on CPU with --device cpu (decoders in "
            f"{', '.join(f'{stage} {dtype}' for stage, dtype in cpu.items())}), {lower}"
        )
    if pinned_fraction is not None:
        per_gpu, fraction = _pinned_share(pinned_fraction, card, memory)
    else:
        cpu_bound = _decoders_the_cpus_hold(inventory, args, overrides) // len(inventory.gpus)
        per_gpu, fraction = _shares(card, memory, cpu_bound)
    count = per_gpu * len(inventory.gpus)
    decoder_args = _scaled(args, count) | {"num_gpus": fraction, "max_batch_size": batch}
    if "autoscaling" not in decoder_args:  # one replica fits: fixed at 1, whatever count the config gives
        deployments = with_options(deployments, GPU_DECODER, {"num_replicas": 1})
    return _plan(args, inventory, dtypes, decoder_args, deployments, memory=memory, per_gpu=per_gpu, fraction=fraction)


def _dtypes(name: str, auto: Callable[[], DecoderDtypes]) -> DecoderDtypes:
    """The decoder's dtypes: `auto`'s (or `auto-int4`'s) choice for the device, or the one named for all three
    modules."""
    if name in (AUTO_DTYPE, AUTO_INT4_DTYPE):
        return auto()
    return DecoderDtypes(*(parse_dtype(name),) * 3, reason="as asked")


def _plan(
    args: AppArgs,
    inventory: Inventory,
    dtypes: DecoderDtypes,
    decoder_args: dict[str, Any],
    deployments: Sequence[Mapping[str, Any]],
    memory: DecoderMemory | None = None,
    per_gpu: int = 0,
    fraction: float = 0.0,
) -> Plan:
    """The plan of a decoder section and the deployments' overrides: on the GPUs with a `memory` footprint, else on
    CPU."""
    decoder = DecoderArgs.model_validate(decoder_args)
    decoder_options = effective_options(
        DEFAULT_OPTIONS[GPU_DECODER], parse_overrides(deployments, DEPLOYMENT_NAMES).get(GPU_DECODER, {})
    )
    return Plan(
        model=args.model,
        inventory=inventory,
        device="cpu" if memory is None else "cuda",
        dtypes=dtypes.describe(),
        dtype_reason=dtypes.reason,
        replicas_per_gpu=per_gpu,
        gpu_fraction=fraction,
        memory=memory,
        max_batch_size=decoder.max_batch_size,
        decoder_args=decoder_args,
        deployments=[dict(entry) for entry in deployments],
        **_replica_range(decoder, replica_floor(decoder_options), args.decoder_cpu.enabled),
    )


def _decoder_memory(sizes: ModelSizes, dtypes: DecoderDtypes, args: AppArgs, max_batch_size: int) -> DecoderMemory:
    weights = sizes.weight_bytes(dtypes)
    asked = args.decoder.memory_budget_gb
    if isinstance(asked, float):
        budget = int(asked * GIB)  # as the decoder reads it
    else:  # `auto` (and None, no byte bound) still needs room for the planned sentences
        budget = planned_budget_bytes(sizes.config, max_batch_size, dtypes.llm.itemsize)
    return DecoderMemory(weights, budget, share_for_budget(weights, budget), CUDA_CONTEXT_BYTES)


def _with_measurement(
    memory: DecoderMemory, gpu: Gpu, dtypes: DecoderDtypes, batch: int, measured: Sequence[MeasuredFootprint]
) -> DecoderMemory:
    """`memory` with the largest peak recorded for the same replica on a card of `gpu`'s name, where there is one."""
    matching = [
        footprint
        for footprint in measured
        if (footprint.gpu_name, footprint.dtypes, footprint.max_batch_size) == (gpu.name, dtypes.describe(), batch)
        and (footprint.weights_bytes, footprint.budget_bytes) == (memory.weights_bytes, memory.budget_bytes)
    ]
    if not matching:
        return memory
    largest = max(matching, key=lambda footprint: footprint.peak_bytes)
    return replace(memory, measured_bytes=largest.peak_bytes, measured_in=largest.source)


def _shares(card: int, memory: DecoderMemory, cpu_bound: int) -> tuple[int, float]:
    """(replicas per card, num_gpus of each): as many as the card holds and the CPUs leave room for, at least one,
    each at an equal part of what their CUDA contexts leave of the card, rounded down to Ray's resource precision."""
    per_gpu = max(1, min(card // memory.total_bytes, cpu_bound))
    while True:
        fraction = math.floor(GPU_FRACTION_STEPS * (card / per_gpu - memory.context_bytes) / card) / GPU_FRACTION_STEPS
        if fraction * card >= memory.share_bytes or per_gpu == 1:
            return per_gpu, fraction
        per_gpu -= 1


def _pinned_share(fraction: float, card: int, memory: DecoderMemory) -> tuple[int, float]:
    """The app args' own num_gpus, checked against the footprint: (replicas it fits on a card, it)."""
    if fraction * card < memory.share_bytes:
        raise PlanError(
            f"decoder.num_gpus {fraction:g} gives a replica {fraction * card / GIB:.2f} GiB of the GPU's "
            f"{card / GIB:.2f} GiB; it needs {memory.share_bytes / GIB:.2f} GiB ({memory.describe()}): raise "
            "num_gpus, lower decoder.max_batch_size, or leave num_gpus out for the plan's"
        )
    return int(1 // fraction), fraction


def _decoders_the_cpus_hold(inventory: Inventory, args: AppArgs, overrides: Mapping[str, Mapping[str, Any]]) -> int:
    """How many decoder replicas Ray can place beside the ingress's and the encoders' floors, by their num_cpus (the
    deployments' options: the code's with the config's overrides)."""
    taken = 0.0
    for name in (INGRESS, ENCODER):
        options = effective_options(DEFAULT_OPTIONS[name], overrides.get(name, {}))
        taken += replica_floor(options) * replica_num_cpus(options)
    return int((inventory.cpus - taken) // args.decoder.num_cpus)


def _scaled(args: AppArgs, count: int) -> dict[str, Any]:
    """The decoder section with its replicas: autoscaled 1-`count` on the decoder policy (the args' own rules kept,
    their max capped at `count`; a schedule of the args' own, else none: a night at 0 needs the CPU fallback), or
    fixed where only one fits (no `autoscaling`: `plan_for` fixes the Decoder's num_replicas at 1)."""
    section = args.decoder.model_dump(exclude={"autoscaling", "num_gpus"}, exclude_unset=True)
    scaling = args.decoder.autoscaling
    if scaling is None and count == 1:
        return section
    own_rules = scaling.rules.model_dump(mode="json", exclude_unset=True) if scaling else {}
    rules = {"min_replicas": 1, "schedule": {"windows": []}} | own_rules
    rules["max_replicas"] = min(rules.get("max_replicas", count), count)
    rules["min_replicas"] = min(rules["min_replicas"], rules["max_replicas"])
    return section | {"autoscaling": {"rules": rules}}


def _cpu_plan(inventory: Inventory, sizes: ModelSizes, args: AppArgs, deployments: Sequence[Mapping[str, Any]]) -> Plan:
    llm_int4 = args.decoder.dtype == AUTO_INT4_DTYPE
    dtypes = _dtypes(args.decoder.dtype, lambda: cpu_auto_choice(inventory.cpu, sizes.gemm, llm_int4))
    section = args.decoder.model_dump(mode="json", exclude={"num_gpus"}, exclude_unset=True) | {"num_gpus": 0}
    return _plan(args, inventory, dtypes, section, deployments)


def _replica_range(decoder: DecoderArgs, fixed_count: int, fallback: bool) -> dict[str, Any]:
    """The decoders' replica bounds (`fixed_count` without autoscaling), and the schedule's windows in words."""
    if decoder.autoscaling is None:
        return {"min_replicas": fixed_count, "max_replicas": fixed_count, "windows": ()}
    rules = decoder.autoscaling.rules
    windows = tuple(
        f"{window.name} {window.start}-{window.end} {rules.schedule.timezone}: "
        + ", ".join(
            f"{bound} {getattr(window, bound + '_replicas')}"
            for bound in ("min", "max")
            if getattr(window, bound + "_replicas") is not None
        )
        + (" (the CPU fallback decoder serves at 0)" if fallback and window.min_replicas == 0 else "")
        for window in rules.schedule.windows
    )
    return {"min_replicas": rules.min_replicas, "max_replicas": rules.max_replicas, "windows": windows}
