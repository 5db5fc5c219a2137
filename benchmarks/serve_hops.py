"""Where a whole request's time goes on its way through Serve, part by part, beside what Serve's hops cost with nothing
behind them.

`overhead_ms_c1` (`benchmarks.compare`) is one figure: a whole request through the local app less the same synthesis
in-process. This splits it per request, by the request's id, from Serve's own request log lines (the proxy's and each
replica's duration of the request; a deployment called more than once for a request, a decoder per sentence, counts
from its first call's start to its last call's end):

- `proxy`: the client's time less the ingress's (HTTP in and out, Serve's proxy and its hop to the ingress replica);
- `ingress`: the ingress's time less its calls' (its own code, and its handle hops to the encoder and the decoder);
- `encoder`: the Encoder's call less the same encoding in-process;
- `decoder`: the Decoder's calls less the same decoding in-process.

The four add up to the request's overhead. Beside them, the floors, taken in the same rounds: `http_floor_ms`, a GET
of a path the app has no route for (the proxy, its hop and the ingress's middlewares with nothing behind them), and
`handle_floor_ms`, the Encoder's `ping` called through a handle from this process (one handle hop with nothing behind
it); `floor_ms` = `http_floor_ms` + 2 x `handle_floor_ms` is the least a whole request's three hops cost. Each figure
is the median over `--repeats` rounds of each round's p50 (ms), with its spread, after `--warmup` untimed rounds.

The default run (tiny, 16 requests per round, 1 + 3 rounds) takes about a minute on the 2-core machine (44 s of
rounds, AMD EPYC, 2026-12-07); the time budget (`--budget-minutes`, default 14) cuts the rounds it leaves no time for,
named in `stopped`.

    python -m benchmarks.serve_hops --out out/serve_hops.json [--model tiny] [--requests 16]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import uuid
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks.compare import CLOSED_LOOP_CLIENTS, PROFILES, app_args_for, load_in_process
from engine.llm.sampling import SamplingOptions
from engine.runtime.synthesis_request import SynthesisRequest
from serve_app.bench.http_load import BENCH_APP, Workload, local_server
from serve_app.bench.progress import BenchmarkRun, add_budget_option
from serve_app.bench.timing import Timing, add_repeat_options

BUDGET_MINUTES = 14.0
PARTS = ("proxy", "ingress", "encoder", "decoder")
FLOORS = ("http_floor_ms", "handle_floor_ms")
NO_ROUTE = "/no-such-route"  # the HTTP floor's GET: answered 404 by the app's router, behind every middleware
INGRESS, ENCODER, DECODER, PROXY = "TTSIngress", "Encoder", "Decoder", "proxy"
# Serve's request log line ends "<method or route> <status> <ms>ms": "POST /v1/tts 200 12.3ms", "CALL encode OK 9.8ms".
DURATION = re.compile(r"(?P<ms>[\d.]+)ms$")
# The proxy's plain-text line: "INFO <date> <time> proxy <ip> <request id> -- POST /v1/tts 200 12.3ms".
PROXY_LINE = re.compile(r" proxy \S+ (?P<request_id>\S+) -- .* (?P<ms>[\d.]+)ms$")


def request_spans(lines: Iterable[str], wanted: set[str]) -> dict[str, dict[str, float]]:
    """Each wanted request id's time per component in ms, from Serve's request log lines: the proxy's ("proxy") and
    each replica's (by its deployment's name), from its first call's start to its last call's end. A replica's JSON
    line carries its end (`timestamp_ns`) and duration; the proxy's plain-text line only its duration (one per
    request)."""
    calls: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            entry = json.loads(line)
            request_id, message = entry.get("request_id"), entry.get("message", "")
            match = DURATION.search(message)
            if request_id not in wanted or match is None or "deployment" not in entry:
                continue
            component = entry["deployment"].rsplit("_", 1)[-1]  # "<app>_<deployment>"
            end_ms = entry["timestamp_ns"] / 1e6
            start_ms = end_ms - float(match["ms"])
        elif (match := PROXY_LINE.search(line)) is not None and match["request_id"] in wanted:
            request_id, component, start_ms, end_ms = match["request_id"], PROXY, 0.0, float(match["ms"])
        else:
            continue
        calls.setdefault(request_id, {}).setdefault(component, []).append((start_ms, end_ms))
    return {
        request_id: {name: max(e for _, e in spans) - min(s for s, _ in spans) for name, spans in components.items()}
        for request_id, components in calls.items()
    }


def parts_of(client_ms: float, encode_ms: float, decode_ms: float, spans: dict[str, float]) -> dict[str, float]:
    """One request's overhead split into `PARTS` (ms; they add up to `client_ms - encode_ms - decode_ms`)."""
    ingress, encoder, decoder = spans[INGRESS], spans[ENCODER], spans[DECODER]
    return {
        "proxy": client_ms - ingress,
        "ingress": ingress - encoder - decoder,
        "encoder": encoder - encode_ms,
        "decoder": decoder - decode_ms,
    }


def serve_log_lines(logs_dir: Path) -> Iterable[str]:
    for path in sorted((logs_dir / "serve").glob("*.log")):
        with path.open(errors="replace") as file:
            yield from file


def p50(values: list[float]) -> float:
    return float(statistics.median(values))


class Rounds:
    """The requests of every timed round: their in-process and client times, and the floors' round trips."""

    def __init__(self, tts: Any, workload: Workload, http: httpx.Client, encoder_handle: Any) -> None:
        self.tts, self.workload, self.http, self.encoder_handle = tts, workload, http, encoder_handle
        self.voice = tts.voices[0]
        self.requests: list[list[tuple[str, float, float, float]]] = []  # per round: (id, client, encode, decode) ms
        self.floors: list[dict[str, float]] = []  # per round: p50 ms of each floor

    def one(self, index: int) -> tuple[str, float, float, float]:
        """One request: in-process encode and decode, then through the app (ms)."""
        body = {**self.workload.body(index, stream=False), "voice": self.voice}
        sampling = SamplingOptions(seed=body["seed"], **body.get("sampling", {}))
        started = time.perf_counter()
        segments = self.tts.encoder.encode(SynthesisRequest(text=body["text"], voice=self.voice, sampling=sampling))
        encoded = time.perf_counter()
        for result in self.tts.decoder.decode_batch(segments):
            if isinstance(result, Exception):
                raise result
        decoded = time.perf_counter()
        request_id = f"hops-{uuid.uuid4().hex}"
        self.http.post("/v1/tts", json=body, headers={"X-Request-ID": request_id}).raise_for_status()
        served = time.perf_counter()
        return request_id, 1000 * (served - decoded), 1000 * (encoded - started), 1000 * (decoded - encoded)

    def floor(self) -> dict[str, float]:
        """One round trip of each floor (ms)."""
        started = time.perf_counter()
        if self.http.get(NO_ROUTE).status_code != 404:
            raise RuntimeError(f"{NO_ROUTE} is meant to be no route of the app")
        http_done = time.perf_counter()
        self.encoder_handle.ping.remote().result()
        return {
            "http_floor_ms": 1000 * (http_done - started),
            "handle_floor_ms": 1000 * (time.perf_counter() - http_done),
        }

    def round(self, timed: bool, bench: BenchmarkRun, label: str) -> None:
        requests, floors = [], []
        for index in range(self.workload.requests_per_level):
            requests.append(self.one(index))
            floors.append(self.floor())
            bench.step(label)
        if timed:
            self.requests.append(requests)
            self.floors.append({key: p50([floor[key] for floor in floors]) for key in floors[0]})


def summary(rounds: Rounds, spans: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Each part's, the overhead's and the floors' median over the rounds of each round's p50 (ms), with spreads; the
    requests whose log lines were not all found are counted in `unmatched_requests` and left out."""
    per_round: dict[str, list[float]] = {key: [] for key in ("overhead_ms", *(f"{p}_ms" for p in PARTS))}
    unmatched = 0
    for requests in rounds.requests:
        found = [
            (client, encode, decode, spans[request_id])
            for request_id, client, encode, decode in requests
            if all(name in spans.get(request_id, {}) for name in (INGRESS, ENCODER, DECODER))
        ]
        unmatched += len(requests) - len(found)
        if not found:
            continue
        per_round["overhead_ms"].append(p50([client - encode - decode for client, encode, decode, _ in found]))
        split = [parts_of(*request) for request in found]
        for part in PARTS:
            per_round[f"{part}_ms"].append(p50([parts[part] for parts in split]))
    figures: dict[str, Any] = {"unmatched_requests": unmatched}
    for key, values in per_round.items():
        figures |= Timing(tuple(values)).fields(key) if values else {key: None}
    floors = {key: Timing(tuple(round_[key] for round_ in rounds.floors)) for key in FLOORS}
    for key, timing in floors.items():
        figures |= timing.fields(key)
    least = [http + 2 * handle for http, handle in zip(*(t.samples for t in floors.values()), strict=True)]
    return figures | Timing(tuple(least)).fields("floor_ms")


def run(model: str, workload: Workload, bench: BenchmarkRun) -> dict[str, Any]:
    import ray
    from ray import serve

    app_args = app_args_for(max(CLOSED_LOOP_CLIENTS), 0.0)  # the app as compare's overhead measure runs it
    bench.plan((workload.warmup + workload.repeats) * workload.requests_per_level)
    setup = {"model": model, "requests": workload.requests_per_level, "repeats": workload.repeats}
    bench.record(setup=setup | {"warmup": workload.warmup, "ray_app_args": app_args})
    tts = load_in_process(model, "cpu")
    with local_server(model, app_args) as url, httpx.Client(base_url=url, timeout=workload.timeout_s) as http:
        rounds = Rounds(tts, workload, http, serve.get_deployment_handle(ENCODER, BENCH_APP))
        for index in range(workload.warmup):
            rounds.round(False, bench, f"warm-up round {index + 1}")
        for index in range(workload.repeats):
            if bench.out_of_time(f"round {index + 1}"):
                break
            rounds.round(True, bench, f"round {index + 1}")
        # Ray 2.60 has no public getter of its log directory; the Serve logs lie under it.
        logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path())
        wanted = {request_id for requests in rounds.requests for request_id, *_ in requests}
        time.sleep(1.0)  # the replicas' last log lines reach their files
        spans = request_spans(serve_log_lines(logs_dir), wanted)
    return summary(rounds, spans) if rounds.requests else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="tiny", help="tiny (default) or dummy (real size)")
    parser.add_argument("--requests", type=int, help="requests per round (default: compare's profile's)")
    add_repeat_options(parser)
    add_budget_option(parser, BUDGET_MINUTES)
    options = parser.parse_args()
    profile = PROFILES.get(options.model, PROFILES["dummy"])
    workload = profile.workload(CLOSED_LOOP_CLIENTS, options.repeats, options.warmup)
    if options.requests:
        workload = replace(workload, requests_per_level=options.requests)
    bench = BenchmarkRun("serve_hops", options.out, options.budget_minutes)
    report = bench.finish(run(options.model, workload, bench))
    print(json.dumps({key: value for key, value in report.items() if not key.endswith("_spread")}, indent=2))


if __name__ == "__main__":
    main()
