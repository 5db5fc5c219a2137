"""The in-process parts of `benchmarks/gpu_check.sh`, one per call (`--part`), each writing its own JSON:

- `precision`: per family and stage, float16, bfloat16 and `auto` against float32 on the same inputs (finite,
  cosine, LLM top-1 agreement, the NaN guard's fallbacks counted);
- `engine`: the decoder in the profile's dtype at batch 1, 4 and 16: finite, RTF, peak memory; a long first chunk;
- `replica`: one decoder replica as `deployments.decoder` builds it, capped at `--fraction` of the card, under mixed
  requests: peak memory against its budget and cap, every request's outcome, NVML readings;
- `sharing`: replicas as processes on one GPU, time-sliced and under an MPS daemon this part starts, under the same
  open-loop streaming load: requests/s, first audio, each replica's peak, `mps_throughput_ratio`.
Each part's inputs and limits: docs/history/performance-runs.md, "The GPU check".

    python -m benchmarks.gpu_check --part precision --out OUT/precision.json [--device cuda]
    python -m benchmarks.gpu_check --part sharing --out OUT/sharing.json [--device cuda] [--replicas 4]

A part writes its JSON as it goes, so one stopped by the script's time box leaves what it measured
(`"complete": false`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.batching_bench import measure_first_chunk
from benchmarks.engine_bench import benchmark_voice, fixed_length_segments
from engine.errors import CosyVoiceError
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import load_model
from engine.nn.precision import FALLBACKS, decoder_dtypes
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.memory import device_memory_budget
from engine.runtime.scheduler import Scheduler
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import SynthesisRequest
from serve_app.bench.timing import DEFAULT_REPEATS, DEFAULT_WARMUP, add_repeat_options, measure

FAMILIES = {  # family -> (preset on CUDA: real sizes, preset on CPU: tiny); v3 first: its bf16 is the open question
    "v3": ("cosyvoice3-0.5b", "cosyvoice3-tiny"),
    "v1": ("dummy", "tiny"),
    "v2": ("cosyvoice2-0.5b", "cosyvoice2-tiny"),
}
REDUCED = ("float16", "bfloat16", "auto")


class Report:
    """A part's JSON, rewritten at every `update` (so a part stopped by its time box leaves what it had)."""

    def __init__(self, path: Path, **fields: Any) -> None:
        self.path = path
        self.data: dict[str, Any] = {"complete": False, **fields}
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2, default=str))

    def done(self) -> None:
        self.update(complete=True)
        print(json.dumps({k: v for k, v in self.data.items() if not isinstance(v, list | dict)}, indent=2))


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_memory_bytes(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def device_fields(device: str) -> dict[str, Any]:
    if device != "cuda":
        return {"device": "cpu", "device_name": "cpu"}
    free, total = torch.cuda.mem_get_info()
    return {
        "device": "cuda",
        "device_name": torch.cuda.get_device_name(),
        "device_memory_bytes": total,
        "device_free_bytes_at_start": free,
        "bf16_native": torch.cuda.is_bf16_supported(including_emulation=False),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }


# --- precision ----------------------------------------------------------------------------------------------------


def cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Cosine similarity of two tensors of one shape, in float64 (None when a shape differs or one is not finite)."""
    a, b = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
    if a.shape != b.shape or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return None
    norms = float(a.norm() * b.norm())
    return 1.0 if norms == 0 and float(a.norm()) == float(b.norm()) else float(a @ b) / norms if norms else 0.0


@torch.inference_mode()
def stage_outputs(model, segment: EncodedSegment, tokens: torch.Tensor, mel_in: torch.Tensor | None) -> dict:
    """The LLM's logits teacher-forced over the prompt + `tokens`, the flow's mel of `tokens`, the vocoder's audio of
    `mel_in` (default: that mel) for `model` (a LoadedModel whose modules may be cast)."""
    decoder = SpeechDecoderStage(model)
    llm = model.llm
    [request] = decoder.generation_requests([segment])
    prompt = llm.lm_input(request)
    speech = llm.speech_embedding(tokens.to(prompt.device)).to(prompt.dtype)
    x = torch.cat([prompt, speech])[None]
    valid = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    hidden = llm.llm.forward_incremental(x, valid, llm.llm.new_cache(1, x.device))
    logits = llm.llm_decoder(hidden).float()[0]
    [mel] = model.flow.inference([decoder.flow_request(segment, decoder.flow_tokens(tokens))])
    mel_in = mel if mel_in is None else mel_in
    [wave] = model.hift.inference([mel_in.to(model.decoder_device, next(model.hift.parameters()).dtype)], seeds=[0])
    _synchronize(model.decoder_device.type)
    return {"llm": logits, "flow": mel.float(), "hift": wave.float()}


def _cast(reference, name: str):
    """A copy of `reference`'s decoder modules in dtype `name` (`auto`: the family's choice on this device)."""
    dtypes = decoder_dtypes(name, reference.config.family.prefers_bfloat16, reference.decoder_device)
    model = copy.copy(reference)
    model.llm = copy.deepcopy(reference.llm).to(dtypes.llm)
    model.flow = copy.deepcopy(reference.flow).to(dtypes.flow)
    model.hift = copy.deepcopy(reference.hift).to(dtypes.hift)
    model.dtype = dtypes.llm
    return model, {"llm": str(dtypes.llm), "flow": str(dtypes.flow), "hift": str(dtypes.hift)}


def precision_family(source: str, device: str, seconds: float) -> dict[str, Any]:
    start = time.perf_counter()
    reference = load_model(source, dtype="float32", device=device, cpu_packing=False)
    encoder = TextEncoderStage(reference)
    [segment] = fixed_length_segments(encoder, seconds)
    with torch.inference_mode():
        [tokens] = SpeechDecoderStage(reference).generate_tokens([segment])
    if len(tokens) == 0:  # random weights may stop at once: a fixed draw instead, the same for every dtype
        tokens = torch.randint(0, reference.llm.eos, (25,), generator=torch.Generator().manual_seed(0))
    tokens = tokens.cpu()
    fp32 = stage_outputs(reference, segment, tokens, None)
    row: dict[str, Any] = {"preset": source, "tokens": len(tokens), "float32_finite": _finite(fp32)}
    for name in REDUCED:
        counts = dict(FALLBACKS.counts)
        model, dtypes = _cast(reference, name)
        out = stage_outputs(model, segment, tokens, fp32["flow"])
        stages = {}
        for stage in ("llm", "flow", "hift"):
            stages[stage] = {"dtype": dtypes[stage], "finite": bool(torch.isfinite(out[stage]).all())}
            stages[stage]["cosine"] = cosine(out[stage], fp32[stage])
        ref_top, top = fp32["llm"].argmax(-1), out["llm"].argmax(-1)
        stages["llm"]["top1_agreement"] = float((ref_top == top).float().mean())
        fallbacks = {
            f"{k[0]}_{'recovered' if k[1] else 'failed'}": v - counts.get(k, 0) for k, v in FALLBACKS.counts.items()
        }
        row[name] = {**stages, "nan_guard_fallbacks": {k: v for k, v in fallbacks.items() if v}}
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    row["seconds"] = round(time.perf_counter() - start, 2)
    del reference
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def _finite(outputs: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in outputs.values())


def run_precision(options: argparse.Namespace) -> None:
    report = Report(options.out, part="precision", **device_fields(options.device), families={})
    worst: dict[str, float] = {}
    for family in options.families:
        cuda_preset, cpu_preset = FAMILIES[family]
        try:
            row = precision_family(
                cuda_preset if options.device == "cuda" else cpu_preset, options.device, options.seconds
            )
        except Exception as exc:  # one family's failure leaves the others' results
            row = {"error": f"{type(exc).__name__}: {exc}"}
        report.data["families"][family] = row
        for name in REDUCED:
            for stage in ("llm", "flow", "hift"):
                value = row.get(name, {}).get(stage, {}).get("cosine")
                if value is not None:
                    key = f"min_cosine_{name}_{stage}"
                    worst[key] = min(worst.get(key, 1.0), value)
        all_finite = all(
            row.get(name, {}).get(stage, {}).get("finite", False)
            for row in report.data["families"].values()
            for name in REDUCED
            for stage in ("llm", "flow", "hift")
        )
        report.update(all_finite=all_finite, **worst)
        print(f"{family}: {json.dumps(row)[:400]}")
    report.done()


# --- engine ---------------------------------------------------------------------------------------------------------


def measure_batch(
    decoder: SpeechDecoderStage,
    segment: EncodedSegment,
    batch: int,
    seconds: float,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
) -> dict[str, Any]:
    """`batch` copies of `segment` through the decoder, `repeats` times after `warmup` untimed runs: whether every
    waveform of every run is finite, the median wall time, RTF and throughput with their spread, and the peak
    device memory over the runs."""
    device = str(decoder.model.decoder_device.type)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    outputs = []

    def run() -> None:
        _synchronize(device)  # the clock reads after the device's queue is done, on both sides
        outputs.append(decoder.decode_batch([segment] * batch))
        _synchronize(device)

    _, wall = measure(run, repeats, warmup)
    finite = all(isinstance(r, np.ndarray) and np.isfinite(r).all() and r.size > 0 for out in outputs for r in out)
    return {
        "batch": batch,
        "finite": finite,
        **wall.fields("wall_s"),
        **wall.map(lambda s: s / seconds).fields("rtf"),  # every request of a fixed-length batch ends with the batch
        **wall.map(lambda s: batch * seconds / s).fields("audio_s_per_s"),
        "peak_memory_bytes": peak_memory_bytes(device),
    }


def run_engine(options: argparse.Namespace) -> None:
    dtype = options.dtype or ("float16" if options.device == "cuda" else "float32")
    model = load_model(options.model, dtype=dtype, device=options.device)
    encoder, decoder = TextEncoderStage(model), SpeechDecoderStage(model)
    repeats, warmup = options.repeats, options.warmup
    report = Report(
        options.out,
        part="engine",
        **device_fields(options.device),
        model=options.model,
        dtype=dtype,
        repeats=repeats,
        warmup=warmup,
        weights_bytes_on_device=peak_memory_bytes(options.device),
        batches=[],
    )
    [segment] = fixed_length_segments(encoder, options.seconds)
    for batch in options.batches:
        row = measure_batch(decoder, segment, batch, options.seconds, repeats, warmup)
        print(f"batch {row['batch']:2d}: RTF {row['rtf']:.3f}, finite {row['finite']}, peak {row['peak_memory_bytes']}")
        report.data["batches"].append(row)
        report.update(
            all_finite=all(r["finite"] for r in report.data["batches"]),
            **{f"rtf_b{batch}": row["rtf"], f"rtf_b{batch}_spread": row["rtf_spread"]},
            **{f"peak_memory_bytes_b{batch}": row["peak_memory_bytes"]},
        )
    [long_segment] = fixed_length_segments(encoder, options.stream_seconds)
    streaming = measure_first_chunk(decoder, long_segment, repeats, warmup)
    seconds = f"{options.stream_seconds:g}s"
    report.update(
        **{
            f"first_chunk_s_{seconds}": streaming["first_chunk_s"],
            f"first_chunk_s_{seconds}_spread": streaming["first_chunk_s_spread"],
            f"first_chunk_fraction_{seconds}": streaming["fraction"],
            f"first_chunk_fraction_{seconds}_spread": streaming["fraction_spread"],
        },
        streaming=streaming,
    )
    report.done()


# --- replica --------------------------------------------------------------------------------------------------------


class NvmlSampler:
    """NVML readings of the first GPU every `interval` s on a thread (nvidia-ml-py); `unavailable` says why not."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self.static: dict[str, Any] = {}
        self.unavailable: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self.static = {
                "name": name.decode() if isinstance(name, bytes) else name,
                "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
                "memory_total_bytes": pynvml.nvmlDeviceGetMemoryInfo(self._handle).total,
            }
        except Exception as exc:  # no nvidia-ml-py, no driver, no GPU
            self.unavailable = f"{type(exc).__name__}: {exc}"

    def _read(self) -> dict[str, float]:
        nvml, handle = self._nvml, self._handle
        reading: dict[str, float] = {"t": time.monotonic()}
        for key, read in (
            ("memory_used_bytes", lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used),
            ("gpu_util_percent", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            ("memory_util_percent", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).memory),
            ("power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000),
            ("temperature_c", lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
            ("sm_clock_mhz", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        ):
            try:
                reading[key] = float(read())
            except Exception:  # a reading this device or driver does not give
                continue
        return reading

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self._read())

    def __enter__(self) -> NvmlSampler:
        if self.unavailable is None:
            self.samples.append(self._read())
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.samples.append(self._read())

    def summary(self) -> dict[str, Any]:
        if self.unavailable is not None:
            return {"unavailable": self.unavailable}
        keys = sorted({k for s in self.samples for k in s} - {"t"})
        return {
            **self.static,
            "samples": len(self.samples),
            **{f"max_{k}": max(s[k] for s in self.samples if k in s) for k in keys},
            **{f"mean_{k}": float(np.mean([s[k] for s in self.samples if k in s])) for k in keys},
        }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def replica_requests(encoder: TextEncoderStage, count: int) -> list[tuple[EncodedSegment, bool]]:
    """`count` requests of growing length (1 to 4 sentences' worth of tokens), every other one streaming."""
    voice = benchmark_voice(encoder.model)
    texts = [
        "Hello there.",
        "A short sentence for the decoder loop.",
        "A longer sentence, with a few clauses in it, that keeps the loop busy for a while longer than the others.",
    ]
    requests = []
    for index in range(count):
        sampling = SamplingOptions(seed=index, min_token_text_ratio=4, max_token_text_ratio=8)
        request = SynthesisRequest(texts[index % len(texts)], voice, sampling=sampling)
        [segment, *_] = encoder.encode(request)
        requests.append((segment, index % 2 == 0))
    return requests


def run_replica(options: argparse.Namespace) -> None:
    device = options.device
    dtype = options.dtype or ("float16" if device == "cuda" else "float32")
    fraction = options.fraction if device == "cuda" else None
    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(fraction)  # as deployments.decoder does with its num_gpus
        torch.cuda.reset_peak_memory_stats()
    model = load_model(options.model, dtype=dtype, device=device)
    weights = torch.cuda.memory_allocated() if device == "cuda" else None
    budget = device_memory_budget(model.decoder_device, fraction)  # what `memory_budget_gb: auto` sets
    cap = int(torch.cuda.get_device_properties(0).total_memory * fraction) if device == "cuda" else None
    report = Report(
        options.out,
        part="replica",
        **device_fields(device),
        model=options.model,
        dtype=dtype,
        gpu_fraction=fraction,
        weights_bytes=weights,
        memory_budget_bytes=budget,
        allocator_cap_bytes=cap,
    )
    encoder, stage = TextEncoderStage(model), SpeechDecoderStage(model)
    requests = replica_requests(encoder, options.requests)
    scheduler = Scheduler(stage, max_live=options.max_live, memory_budget_bytes=budget)
    outputs: list[list[Any]] = [[] for _ in requests]
    errors: list[str] = []
    start = time.perf_counter()
    with NvmlSampler() as nvml:
        try:
            for index, (segment, streaming) in enumerate(requests):
                scheduler.submit([segment], streaming=streaming, sink=outputs[index].append)
            deadline = time.monotonic() + options.loop_timeout_s
            while scheduler.has_work and time.monotonic() < deadline:
                scheduler.step()
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            _synchronize(device)
    elapsed = time.perf_counter() - start
    ended = [bool(out) and out[-1] is None for out in outputs]
    failed = [_text(o) for out in outputs for o in out if isinstance(o, Exception)]
    audio = [
        np.concatenate([o for o in out if isinstance(o, np.ndarray) and o.size] or [np.zeros(0)]) for out in outputs
    ]
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    report.update(
        requests=len(requests),
        streaming_requests=sum(s for _, s in requests),
        all_ended=all(ended),
        request_errors=failed,
        loop_errors=errors,
        all_finite=all(np.isfinite(a).all() and a.size > 0 for a in audio),
        audio_seconds=float(sum(a.size for a in audio) / stage.sample_rate),
        wall_s=round(elapsed, 3),
        first_lane_chunks=scheduler.stats.first_lane_chunks,
        llm_steps=scheduler.stats.llm_steps,
        peak_memory_bytes=peak,
        peak_reserved_bytes=torch.cuda.max_memory_reserved() if device == "cuda" else None,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        # the loop's own use over the weights, against what the budget lets it have
        peak_over_weights_bytes=None if peak is None else peak - weights,
        peak_over_weights_vs_budget=None if peak is None or not budget else (peak - weights) / budget,
        peak_within_cap=None if peak is None else peak <= cap,
        nvml=nvml.summary(),
    )
    report.done()


# --- sharing ---------------------------------------------------------------------------------------------------

MPS_CONTROL = "nvidia-cuda-mps-control"


def run_sharing_worker(options: argparse.Namespace) -> None:
    """One replica in its own process, driven by JSON lines: it prints {"ready"} once loaded, then for each
    {"start_at", "arrivals"} on stdin submits a stream at each arrival (seconds after `start_at`, a wall-clock time)
    and prints each stream's outcome once all have ended; {"quit"}: its peak memory, and it exits."""
    replies, sys.stdout = sys.stdout, sys.stderr  # stdout carries the replies only, whatever else prints
    device = options.device
    dtype = options.dtype or ("float16" if device == "cuda" else "float32")
    fraction = options.fraction if device == "cuda" else None
    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(fraction)  # as deployments.decoder does with its num_gpus
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // options.replicas))  # the replicas share the cores
    model = load_model(options.model, dtype=dtype, device=device)
    encoder, stage = TextEncoderStage(model), SpeechDecoderStage(model)
    scheduler = Scheduler(
        stage, max_live=options.max_live, memory_budget_bytes=device_memory_budget(model.decoder_device, fraction)
    )
    pool = [segment for segment, _ in replica_requests(encoder, 6)]
    loop_errors: list[str] = []

    def on_error(exc: Exception) -> CosyVoiceError:
        loop_errors.append(f"{type(exc).__name__}: {exc}")
        return CosyVoiceError(f"the loop failed: {type(exc).__name__}")

    threading.Thread(target=scheduler.run, args=(lambda _: None, on_error), daemon=True).start()
    cap = int(torch.cuda.get_device_properties(0).total_memory * fraction) if device == "cuda" else None

    def reply(**fields: Any) -> None:
        print(json.dumps(fields), file=replies, flush=True)

    reply(ready=True, cap_bytes=cap, weights_bytes=torch.cuda.memory_allocated() if device == "cuda" else None)
    for line in sys.stdin:
        order = json.loads(line)
        if order.get("quit"):
            break
        streams = _serve_level(scheduler, pool, order["start_at"], order["arrivals"], options.drain_s)
        reply(streams=streams, sample_rate=stage.sample_rate, loop_errors=loop_errors)
    reply(
        peak_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        out_of_memory=scheduler.stats.out_of_memory,
    )


def _serve_level(
    scheduler: Scheduler, pool: list[EncodedSegment], start_at: float, arrivals: list[float], drain_s: float
) -> list[dict[str, Any]]:
    """Submit a stream at each arrival (seconds after `start_at`, a wall-clock time) -> each stream's outcome, once all
    have ended or `drain_s` passed."""
    streams = [{"arrival_s": at, "first_audio_s": None, "end_s": None, "samples": 0, "error": None} for at in arrivals]
    ended = threading.Semaphore(0)

    def sink(stream: dict[str, Any]) -> Callable[[Any], None]:
        def take(item: Any) -> None:
            now = time.time() - start_at
            if isinstance(item, np.ndarray) and item.size:
                stream["samples"] += item.size
                if stream["first_audio_s"] is None:
                    stream["first_audio_s"] = now
            elif isinstance(item, Exception):
                stream["error"] = _text(item)
            elif item is None:
                stream["end_s"] = now
                ended.release()

        return take

    for index, stream in enumerate(streams):
        time.sleep(max(0.0, start_at + stream["arrival_s"] - time.time()))
        try:
            scheduler.submit([pool[index % len(pool)]], streaming=True, sink=sink(stream))
        except Exception as exc:  # refused: it never ends in the loop
            stream["error"] = _text(exc)
            ended.release()
    deadline = time.monotonic() + drain_s
    for _ in streams:
        ended.acquire(timeout=max(0.0, deadline - time.monotonic()))
    return streams


class _Worker:
    """A `sharing-worker` process and its JSON-line replies."""

    def __init__(self, options: argparse.Namespace, fraction: float, replicas: int, env: dict[str, str]) -> None:
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--part", "sharing-worker", "--out", os.devnull]
        command += ["--device", options.device, "--model", options.model, "--fraction", str(fraction)]
        command += ["--replicas", str(replicas), "--max-live", str(options.max_live), "--drain-s", str(options.drain_s)]
        command += ["--dtype", options.dtype] if options.dtype else []
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env}
        )

    def send(self, **order: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(order) + "\n")
        self.process.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"a sharing worker ended (exit {self.process.wait()}) without replying")
        return json.loads(line)

    def close(self) -> dict[str, Any]:
        self.send(quit=True)
        last = self.reply()
        self.process.wait(timeout=30)
        return last


class _MpsDaemon:
    """An MPS control daemon in a folder of its own, for this part's MPS run (`env` points the workers to it)."""

    def __init__(self, folder: Path) -> None:
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
        for path in self.env.values():
            Path(path).mkdir(parents=True)
        subprocess.run([MPS_CONTROL, "-d"], env={**os.environ, **self.env}, check=True, timeout=30)

    def servers(self) -> list[str]:
        """The MPS servers' process ids (one once a client started CUDA)."""
        out = subprocess.run(
            [MPS_CONTROL], input="get_server_list\n", env={**os.environ, **self.env}, capture_output=True, text=True
        )
        return out.stdout.split()

    def quit(self) -> None:
        subprocess.run([MPS_CONTROL], input="quit\n", env={**os.environ, **self.env}, timeout=30)


def sharing_arrivals(clients: int, period_s: float, duration_s: float) -> list[float]:
    """The open-loop schedule: each client starts a stream every `period_s` for `duration_s`, the clients spread
    evenly over a period; offsets in seconds, sorted."""
    per_client = max(1, round(duration_s / period_s))
    return sorted(k * period_s + c * period_s / clients for c in range(clients) for k in range(per_client))


def _level_figures(streams: list[dict[str, Any]], sample_rate: int) -> dict[str, Any]:
    done = [s for s in streams if s["end_s"] is not None and s["error"] is None]
    span = max((s["end_s"] for s in done), default=0.0)
    ttfa = [s["first_audio_s"] - s["arrival_s"] for s in done if s["first_audio_s"] is not None]
    audio_s = sum(s["samples"] for s in done) / sample_rate
    return {
        "requests": len(streams),
        "completed": len(done),
        "errors": sorted({s["error"] for s in streams if s["error"]}),
        "requests_per_s": len(done) / span if span else None,
        "audio_s_per_s": audio_s / span if span else None,
        "ttfa_p50_s": float(np.percentile(ttfa, 50)) if ttfa else None,
        "ttfa_p95_s": float(np.percentile(ttfa, 95)) if ttfa else None,
    }


def run_sharing_config(
    options: argparse.Namespace, replicas: int, fraction: float, env: dict[str, str], daemon: _MpsDaemon | None
) -> dict[str, Any]:
    """One sharing configuration: its workers, the load at each client count, their peaks."""
    workers = [_Worker(options, fraction, replicas, env) for _ in range(replicas)]
    try:
        ready = [worker.reply() for worker in workers]
        result: dict[str, Any] = {"replicas": replicas, "fraction": fraction, "levels": {}}
        if daemon is not None:
            result["mps_servers"] = daemon.servers()  # non-empty: the workers did connect to the daemon
        for clients in options.clients:
            arrivals = sharing_arrivals(clients, options.period_s, options.duration_s)
            start_at = time.time() + 0.5
            for index, worker in enumerate(workers):  # round-robin, as a router spreads streams
                worker.send(start_at=start_at, arrivals=arrivals[index::replicas])
            replies = [worker.reply() for worker in workers]
            streams = [stream for reply in replies for stream in reply["streams"]]
            result["levels"][str(clients)] = {
                **_level_figures(streams, replies[0]["sample_rate"]),
                "loop_errors": sorted({e for reply in replies for e in reply["loop_errors"]}),
            }
        closed = [worker.close() for worker in workers]
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.kill()
    caps = [r["cap_bytes"] for r in ready]
    peaks = [c["peak_bytes"] for c in closed]
    result.update(
        per_replica_peak_gb=[None if p is None else round(p / 2**30, 3) for p in peaks],
        per_replica_cap_gb=[None if c is None else round(c / 2**30, 3) for c in caps],
        within_caps=None if None in peaks else all(p <= c for p, c in zip(peaks, caps, strict=True)),
        out_of_memory=sum(c["out_of_memory"] for c in closed),
    )
    return result


def run_sharing(options: argparse.Namespace) -> None:
    report = Report(
        options.out,
        part="sharing",
        **device_fields(options.device),
        model=options.model,
        clients=options.clients,
        period_s=options.period_s,
        duration_s=options.duration_s,
        configs={},
    )
    mps_skip = None
    if options.device != "cuda":
        mps_skip = "MPS needs CUDA"
    elif shutil.which(MPS_CONTROL) is None:
        mps_skip = f"{MPS_CONTROL} is not on PATH"
    with tempfile.TemporaryDirectory(prefix="gpu_check_mps_") as folder:
        no_mps = {"CUDA_MPS_PIPE_DIRECTORY": str(Path(folder) / "no-daemon")}  # an empty folder: CUDA finds no MPS
        Path(no_mps["CUDA_MPS_PIPE_DIRECTORY"]).mkdir()
        runs = [
            ("1x1.0", 1, 1.0, False),
            (f"{options.replicas}x{options.fraction:g}", options.replicas, options.fraction, False),
        ]
        if mps_skip is None:
            runs.append((f"{options.replicas}x{options.fraction:g}_mps", options.replicas, options.fraction, True))
        for name, replicas, fraction, mps in runs:
            daemon = _MpsDaemon(Path(folder) / "mps") if mps else None
            try:
                result = run_sharing_config(options, replicas, fraction, daemon.env if daemon else no_mps, daemon)
            finally:
                if daemon is not None:
                    daemon.quit()
            report.data["configs"][name] = result
            report.write()
    configs = report.data["configs"]
    top = str(max(options.clients))
    time_sliced = configs[runs[1][0]]["levels"][top]["requests_per_s"]
    with_mps = configs[runs[2][0]]["levels"][top]["requests_per_s"] if mps_skip is None else None
    report.update(
        mps_skipped=mps_skip,
        mps_throughput_ratio=with_mps / time_sliced if with_mps and time_sliced else None,
        per_replica_peak_gb={name: c["per_replica_peak_gb"] for name, c in configs.items()},
        all_within_caps=None if options.device != "cuda" else all(c["within_caps"] for c in configs.values()),
        requests_lost=sum(
            level["requests"] - level["completed"] for c in configs.values() for level in c["levels"].values()
        ),
    )
    report.done()


# --- command line -----------------------------------------------------------------------------------------------


PARTS: dict[str, Callable[[argparse.Namespace], None]] = {
    "precision": run_precision,
    "engine": run_engine,
    "replica": run_replica,
    "sharing": run_sharing,
    "sharing-worker": run_sharing_worker,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=sorted(PARTS), default="engine")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--model", default="dummy", help="engine and replica: the preset or model directory")
    parser.add_argument("--dtype", help="engine and replica: the decoder dtype (default float16 on CUDA, else float32)")
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seconds", type=float, default=2.0, help="audio per request of the batches / precision")
    parser.add_argument("--stream-seconds", type=float, default=20.0)
    parser.add_argument("--fraction", type=float, default=0.25, help="replica: its GPU fraction (every profile's)")
    parser.add_argument("--requests", type=int, default=16, help="replica: requests submitted at once")
    parser.add_argument("--max-live", type=int, default=8, help="replica: the loop's max_batch_size")
    parser.add_argument("--loop-timeout-s", type=float, default=60.0, help="replica: the loop's longest run")
    parser.add_argument("--replicas", type=int, default=4, help="sharing: replicas at --fraction on the GPU")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="sharing: the load levels")
    parser.add_argument("--period-s", type=float, default=2.0, help="sharing: each client's stream interval")
    parser.add_argument("--duration-s", type=float, default=8.0, help="sharing: how long each level's arrivals go on")
    parser.add_argument("--drain-s", type=float, default=30.0, help="sharing: the longest wait for a level's streams")
    add_repeat_options(parser)
    options = parser.parse_args()
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    if not 0 < options.fraction <= 1:
        parser.error("--fraction must be in (0, 1]")
    PARTS[options.part](options)


if __name__ == "__main__":
    main()
