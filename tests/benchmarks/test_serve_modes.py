"""`benchmarks.serve_modes` (Serve's modes side by side) and the figures `compare --hops-only` gives it, without a
Ray cluster: which variables each mode's run gets, its ratios to the same round's defaults, and what the replicas
were started with, read back from their processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.compare import replica_serve_env, stream_figures
from benchmarks.serve_modes import PARTS, RAY_DEFAULTS, THROUGHPUT_OPTIMIZED, mode_env, run_environment, summary
from serve_app.bench.http_load import LevelResult
from serve_app.bench.timing import FailedMeasurements, Timing


def test_a_part_states_rays_default_for_the_others_and_an_operators_export_does_not_leak_in() -> None:
    grpc = mode_env("grpc")
    assert grpc["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "1"
    assert {key: value for key, value in grpc.items() if key != "RAY_SERVE_USE_GRPC_BY_DEFAULT"} == {
        key: value for key, value in RAY_DEFAULTS.items() if key != "RAY_SERVE_USE_GRPC_BY_DEFAULT"
    }
    # the whole mode sets only its switch: a stated default would override what it turns on
    assert mode_env("throughput-optimized") == {THROUGHPUT_OPTIMIZED: "1"}
    assert set(PARTS) == {"grpc", "user-loop", "router-loop", "direct-ingress", "log-buffer"}
    assert all(set(part) <= set(RAY_DEFAULTS) for part in PARTS.values())  # what run_environment clears

    exported = {"PATH": "/bin", THROUGHPUT_OPTIMIZED: "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
    assert run_environment("default", exported) == {"PATH": "/bin", **RAY_DEFAULTS}
    assert run_environment("throughput-optimized", exported) == {"PATH": "/bin", THROUGHPUT_OPTIMIZED: "1"}


def _run(mode: str, overhead_ms: float | None, first_byte_s: float, bytes_per_s: float) -> dict[str, object]:
    return {
        "mode": mode,
        "overhead_ms_c1": overhead_ms,
        "stream_first_byte_s_c1": first_byte_s,
        "stream_bytes_per_s_c8": bytes_per_s,
    }


def test_ratios_are_taken_round_by_round_and_one_outside_its_bound_is_a_failed_measurement() -> None:
    rounds = [
        {"default": _run("default", 40.0, 0.2, 1000.0), "grpc": _run("grpc", 20.0, 0.1, 2000.0)},
        {"default": _run("default", 80.0, 0.4, 1000.0), "grpc": _run("grpc", 40.0, 0.2, 2000.0)},
        {"default": _run("default", 60.0, 0.3, 1000.0), "grpc": _run("grpc", 30.0, 0.15, 2000.0)},
    ]
    failed = FailedMeasurements()
    figures = summary(rounds, ["grpc"], failed)
    # each round halves the default's overhead, however the rounds' levels drift: the ratio's spread is 0
    assert figures["grpc"]["overhead_ms_c1_ratio"] == 0.5
    assert figures["grpc"]["overhead_ms_c1_ratio_spread"] == {"min": 0.5, "max": 0.5, "n": 3}
    assert figures["grpc"]["stream_bytes_per_s_c8_ratio"] == 2.0
    assert figures["default"]["overhead_ms_c1"] == 60.0 and "overhead_ms_c1_ratio" not in figures["default"]
    assert not failed.entries

    rounds[1]["default"]["overhead_ms_c1"] = 0.0  # a default overhead of 0: its ratio says nothing
    failed = FailedMeasurements()
    figures = summary(rounds, ["grpc"], failed)
    assert figures["grpc"]["overhead_ms_c1_ratio"] is None
    assert [entry["name"] for entry in failed.entries] == ["grpc.overhead_ms_c1_ratio"]


def test_stream_figures_are_the_first_byte_at_one_client_and_the_bytes_per_second_of_the_most() -> None:
    def stream_level(concurrency: int, first_chunk_p50_s: float, audio_s_per_s: tuple[float, ...]) -> LevelResult:
        return LevelResult(
            "stream", concurrency, 4, 0, 1.0, first_chunk_s={"p50": first_chunk_p50_s}, throughput=Timing(audio_s_per_s)
        )

    levels = [stream_level(1, 0.2, (1.0, 1.0, 1.0)), stream_level(8, 0.9, (2.0, 3.0, 4.0))]
    figures = stream_figures(levels, 8, sample_rate=22050)
    assert figures["stream_first_byte_s_c1"] == 0.2
    assert figures["stream_bytes_per_s_c8"] == 3.0 * 22050 * 2  # 16-bit PCM, the median repeat
    assert figures["stream_bytes_per_s_c8_spread"]["min"] == 2.0 * 22050 * 2
    cut = stream_figures(levels[:1], 8, sample_rate=22050)  # the time budget left the 8-client level out
    assert cut == {"stream_first_byte_s_c1": 0.2, "stream_bytes_per_s_c8": None, "stream_bytes_per_s_c8_spread": None}


def test_what_a_replica_was_started_with_is_read_back_from_its_process() -> None:
    title = "ray::ServeReplica:app:Decoder"
    env = {"PATH": os.environ["PATH"], "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "OTHER": "x"}
    # a child named as Ray names a replica's process, with a Serve variable in its environment
    child = subprocess.Popen(
        ["bash", "-c", f"exec -a {title} {sys.executable} -c 'import time; time.sleep(30)'"], env=env
    )
    try:
        deadline = time.monotonic() + 10
        while not (found := replica_serve_env(os.getpid())) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the exec has happened
        assert found == [{"replica": title, "pid": child.pid, "env": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}}]
    finally:
        child.kill()
        child.wait()
