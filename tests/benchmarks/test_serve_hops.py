"""`benchmarks.serve_hops`: a request's time per component read from Serve's log lines, and its overhead's parts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks.serve_hops import PARTS, parts_of, request_spans, summary


def replica_line(request_id: str, deployment: str, message: str, end_ms: float) -> str:
    entry = {
        "levelname": "INFO",
        "message": message,
        "request_id": request_id,
        "deployment": f"cosyvoice-bench_{deployment}",
        "timestamp_ns": int(end_ms * 1e6),
    }
    return json.dumps(entry) + "\n"


def proxy_line(request_id: str, ms: float) -> str:
    return f"INFO 2026-12-07 23:31:33,202 proxy 192.0.2.2 {request_id} -- POST /v1/tts 200 {ms}ms\n"


def test_a_request_s_components_are_read_from_serve_s_lines_and_repeated_calls_span_first_start_to_last_end() -> None:
    lines = [
        proxy_line("a", 60.0),
        replica_line("a", "TTSIngress", "POST /v1/tts 200 50.0ms", 1050.0),
        replica_line("a", "Encoder", "encoded 1 segment(s)", 1009.0),  # not a request line: no duration
        replica_line("a", "Encoder", "CALL encode OK 8.0ms", 1010.0),
        # two sentences decoded by two calls: from 1012 to 1044
        replica_line("a", "Decoder", "CALL synthesize OK 30.0ms", 1042.0),
        replica_line("a", "Decoder", "CALL synthesize OK 31.0ms", 1044.0),
        replica_line("other", "Decoder", "CALL synthesize OK 5.0ms", 1044.0),  # not asked for
        "a line of some other shape\n",
    ]
    spans = request_spans(lines, {"a", "missing"})
    assert spans == {"a": {"proxy": 60.0, "TTSIngress": 50.0, "Encoder": 8.0, "Decoder": pytest.approx(32.0)}}


def test_the_parts_add_up_to_the_overhead_over_in_process() -> None:
    spans = {"TTSIngress": 50.0, "Encoder": 8.0, "Decoder": 32.0}
    parts = parts_of(client_ms=60.0, encode_ms=5.0, decode_ms=25.0, spans=spans)
    assert parts == {"proxy": 10.0, "ingress": 10.0, "encoder": 3.0, "decoder": 7.0}
    assert sum(parts.values()) == 60.0 - 5.0 - 25.0


def test_summary_takes_each_round_s_p50_leaves_out_requests_without_their_lines_and_adds_the_floors() -> None:
    spans = {f"r{i}": {"TTSIngress": 50.0, "Encoder": 8.0, "Decoder": 32.0} for i in range(6)}
    spans["r5"].pop("Decoder")  # its decoder's line was not found: left out
    rounds = SimpleNamespace(
        requests=[
            [("r0", 60.0, 5.0, 25.0), ("r1", 61.0, 5.0, 25.0), ("r2", 62.0, 5.0, 25.0)],
            [("r3", 63.0, 5.0, 25.0), ("r4", 64.0, 5.0, 25.0), ("r5", 65.0, 5.0, 25.0)],
            [("r0", 60.0, 5.0, 25.0), ("lost", 70.0, 5.0, 25.0)],
        ],
        floors=[
            {"http_floor_ms": 10.0, "handle_floor_ms": 4.0},
            {"http_floor_ms": 12.0, "handle_floor_ms": 5.0},
            {"http_floor_ms": 11.0, "handle_floor_ms": 3.0},
        ],
    )
    figures = summary(rounds, spans)
    assert figures["unmatched_requests"] == 2
    # round p50s of the overhead: 31 (30, 31, 32), 33.5 (33, 34), 30 (30)
    assert figures["overhead_ms"] == 31.0
    assert figures["overhead_ms_spread"] == {"min": 30.0, "max": 33.5, "n": 3}
    # the clients' extra time is the proxy's part
    assert {part: figures[f"{part}_ms"] for part in PARTS} == {
        "proxy": 11.0,
        "ingress": 10.0,
        "encoder": 3.0,
        "decoder": 7.0,
    }
    assert figures["floor_ms"] == 18.0  # per round 18, 22, 17
    assert figures["floor_ms_spread"] == {"min": 17.0, "max": 22.0, "n": 3}
