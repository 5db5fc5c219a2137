"""Request ids, structured logs, Prometheus metrics and the benchmarks, on a real local Ray Serve (tiny model)."""

from __future__ import annotations

import glob
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")
from autoscaling.policy import DecoderAutoscalingPolicy, ScalingRules  # noqa: E402
from benchmarks.baseline_server import build_baseline  # noqa: E402
from engine.runtime.pipeline import CosyVoice  # noqa: E402
from observability import metrics  # noqa: E402
from observability.http import is_valid_request_id  # noqa: E402
from serve_app.bench.http_load import free_port, percentiles  # noqa: E402
from serve_app.cli import main as cli_main  # noqa: E402
from tests.autoscaling.test_autoscaling_policy import NO_SCHEDULE, NOON, make_context  # noqa: E402
from tests.serve.conftest import on_cpus, running_app  # noqa: E402

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

APP_NAME = "observability-test"
SHORT = {"sampling": {"max_token_text_ratio": 3.0}}  # keeps dummy-weight decodes short on 2 CPUs
POLL_S = 60.0  # Ray exports metrics every few seconds, and replica logs land in files
IDLE_SCRAPE_GAP_S = 40.0


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    """(base URL, Prometheus export port) of the tiny app."""
    metrics_port = free_port()
    args = {
        "model": "tiny",
        "decoder": {"num_cpus": 0.5, "max_batch_size": 4, "batch_wait_timeout_s": 0.2},
    }
    with running_app(
        args, APP_NAME, deployments=on_cpus(TTSIngress=0.25, Encoder=0.25), _metrics_export_port=metrics_port
    ) as url:
        yield url, metrics_port


@pytest.fixture(scope="module")
def client(server: tuple[str, int]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=120) as http:
        yield http


def poll(check: Callable[[], Any], what: str) -> Any:
    """`check()`'s first truthy answer within POLL_S, else fail naming `what`."""
    deadline = time.monotonic() + POLL_S
    while time.monotonic() < deadline:
        answer = check()
        if answer:
            return answer
        time.sleep(1.0)
    pytest.fail(f"timed out waiting for {what}")


# --- request ids --------------------------------------------------------------------------------------


def test_request_id_is_echoed_or_made_on_every_response(client: httpx.Client) -> None:
    ok = client.post("/v1/tts", json={"text": "Hi.", "seed": 1, **SHORT}, headers={"X-Request-ID": "client-id.42"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "client-id.42"
    made = [client.post("/v1/tts", json={"text": "Hi.", "voice": "nobody"}) for _ in range(2)]
    assert [r.status_code for r in made] == [404, 404]  # an error response carries one too
    assert made[0].headers["x-request-id"] != made[1].headers["x-request-id"]
    assert all(is_valid_request_id(r.headers["x-request-id"]) for r in made)
    missing = client.get("/v1/no-such-route", headers={"X-Request-ID": "abc"})
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "abc"


@pytest.mark.parametrize("bad_id", ["has space", "x" * 129, "semi;colon", "<script>"])
def test_unsafe_request_ids_are_rejected_with_a_json_400(client: httpx.Client, bad_id: str) -> None:
    response = client.post("/v1/tts", json={"text": "Hi."}, headers={"X-Request-ID": bad_id})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_request_id" and "X-Request-ID" in error["message"]


def _log_records(request_id: str) -> dict[str, list[dict[str, Any]]]:
    """JSON log records that name `request_id`, by deployment (from the replicas' log files)."""
    log_dir = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    found: dict[str, list[dict[str, Any]]] = {}
    for path in glob.glob(str(log_dir / f"replica_{APP_NAME}_*.log")):
        deployment = Path(path).name.split("_")[-2]
        for line in Path(path).read_text().splitlines():
            if request_id not in line or not line.startswith("{"):
                continue
            record = json.loads(line)
            if record.get("request_id") == request_id or request_id in record.get("request_ids", []):
                found.setdefault(deployment, []).append(record)
    return found


def _stage_logs(request_id: str) -> dict[str, set[str]] | None:
    """{deployment: messages} once the ingress, encoder and decoder all logged their own lines for the id."""
    messages = {name: {r["message"] for r in records} for name, records in _log_records(request_id).items()}
    complete = (
        any(m.startswith("synthesis of") for m in messages.get("TTSIngress", ()))
        and any(m.startswith("encoded") for m in messages.get("Encoder", ()))
        and {"batch started", "segment done"} <= messages.get("Decoder", set())
    )
    return messages if complete else None


def test_request_id_follows_the_request_through_every_stage(client: httpx.Client) -> None:
    for stream in (False, True):
        request_id = f"trace-{int(stream)}-{time.monotonic_ns()}"
        body = {"text": "One sentence here. And another one there.", "stream": stream, "format": "pcm", **SHORT}
        response = client.post("/v1/tts", json=body, headers={"X-Request-ID": request_id})
        assert response.status_code == 200
        poll(lambda rid=request_id: _stage_logs(rid), f"the stages' log lines for {request_id}")
        batches = [r for r in _log_records(request_id)["Decoder"] if r["message"] == "batch started"]
        assert {r["path"] for r in batches} == {"stream" if stream else "whole"}


# --- metrics ---------------------------------------------------------------------------------------------


def _samples(metrics_port: int) -> list[Any]:
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return []
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def _value(samples: list[Any], name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels` (Ray adds its own labels)."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def test_metrics_are_exported_with_their_tags(client: httpx.Client, server: tuple[str, int]) -> None:
    metrics_port = server[1]
    for stream in (False, True):
        body = {"text": "Counting requests.", "stream": stream, "format": "pcm", "seed": 3, **SHORT}
        assert client.post("/v1/tts", json=body).status_code == 200
    assert client.post("/v1/tts", json={"text": "Hi.", "voice": "nobody"}).status_code == 404
    assert client.get("/v1/voices").status_code == 200

    ingress = {"application": APP_NAME, "deployment": "TTSIngress"}

    def exported() -> list[Any] | None:
        samples = _samples(metrics_port)
        wanted = [
            _value(samples, "ray_" + metrics.REQUESTS, endpoint="/v1/tts", status_code="200", **ingress),
            _value(samples, "ray_" + metrics.REQUESTS, endpoint="/v1/tts", status_code="404", **ingress),
            _value(samples, "ray_" + metrics.REQUESTS, endpoint="/v1/voices", status_code="200", **ingress),
            _value(samples, f"ray_{metrics.FIRST_CHUNK}_count", endpoint="/v1/tts", mode="stream", **ingress),
            _value(samples, f"ray_{metrics.REQUEST_LATENCY}_count", endpoint="/v1/tts", mode="whole", **ingress),
            _value(samples, f"ray_{metrics.BATCH_SIZE}_count", path="stream", deployment="Decoder"),
        ]
        return samples if all(wanted) else None

    samples = poll(exported, "exported metrics")
    assert _value(samples, f"ray_{metrics.AUDIO_SECONDS}", mode="whole", **ingress) > 0
    assert _value(samples, f"ray_{metrics.REAL_TIME_FACTOR}_count", mode="stream", **ingress) >= 1
    assert _value(samples, f"ray_{metrics.BATCH_SIZE}_count", path="whole", deployment="Decoder") >= 1
    # Gauges exist per decoder replica (0 bytes: this replica runs on CPU).
    assert any(s.name == "ray_" + metrics.GPU_MEMORY_ALLOCATED and s.value == 0 for s in samples)
    assert any(s.name == "ray_" + metrics.DECODER_QUEUE_DEPTH for s in samples)
    assert any(s.name == "ray_" + metrics.DECODER_LIVE_LIMIT and s.value >= 1 for s in samples)  # no OOM: max batch
    assert any(s.name == "ray_" + metrics.DECODER_BISTREAM_SLOTS_FREE and s.value >= 1 for s in samples)  # none taken


def test_dashboard_charts_every_metric() -> None:
    dashboard = Path(metrics.__file__).with_name("grafana_dashboard.json")
    expressions = " ".join(
        target["expr"] for panel in json.loads(dashboard.read_text())["panels"] for target in panel.get("targets", [])
    )
    names = [value for key, value in vars(metrics).items() if key.isupper() and isinstance(value, str)]
    assert names and all(f"ray_{name}" in expressions for name in names)


# --- autoscaling decisions ----------------------------------------------------------------------------


class RecordingCounter:
    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []
        self.values: list[float] = []

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.calls.append(dict(tags or {}))
        self.values.append(value)


def test_autoscaling_decisions_are_counted_once_with_their_reason() -> None:
    policy = DecoderAutoscalingPolicy(**{**ScalingRules(schedule=NO_SCHEDULE).to_kwargs(), "max_replicas": 8})
    counter = RecordingCounter()
    policy._metrics = type("Metrics", (), {"decisions": counter})()
    burst = make_context(NOON, target=1, utilization=0.5, queue_per_replica=20.0)
    assert policy(burst)[0] == 2
    assert policy(burst)[0] == 2  # asked again before Serve applied it: not a new decision
    assert counter.calls == [{"deployment": "decoder", "direction": "up", "reason": "queue_depth"}]
    assert policy(make_context(NOON, target=2, utilization=0.5))[0] == 2  # holds: nothing counted
    assert len(counter.calls) == 1


def test_precision_fallbacks_are_counted_by_stage_and_outcome() -> None:
    decoder_metrics = metrics.DecoderMetrics.__new__(metrics.DecoderMetrics)  # no Ray: only the counter is used
    decoder_metrics.precision_fallbacks = RecordingCounter()
    decoder_metrics.record_precision_fallback("flow", True)
    decoder_metrics.record_precision_fallback("vocoder", False)
    assert decoder_metrics.precision_fallbacks.calls == [
        {"stage": "flow", "recovered": "true"},
        {"stage": "vocoder", "recovered": "false"},
    ]


def test_prompt_cache_lookups_are_counted_from_the_caches_running_totals() -> None:
    decoder_metrics = metrics.DecoderMetrics.__new__(metrics.DecoderMetrics)  # no Ray: the instruments are stand-ins
    decoder_metrics.prompt_cache_lookups = RecordingCounter()
    decoder_metrics.prompt_cache_bytes = type("Gauge", (), {"set": lambda self, value: setattr(self, "value", value)})()
    decoder_metrics._prompt_cache_counted = {"hit": 0, "miss": 0}
    decoder_metrics.record_prompt_cache(hits=0, misses=1, nbytes=100)
    decoder_metrics.record_prompt_cache(hits=3, misses=1, nbytes=100)  # nothing new missed: no increment of 0
    decoder_metrics.record_prompt_cache(hits=3, misses=1, nbytes=0)
    lookups = decoder_metrics.prompt_cache_lookups
    assert list(zip(lookups.calls, lookups.values, strict=True)) == [({"result": "miss"}, 1), ({"result": "hit"}, 3)]
    assert decoder_metrics.prompt_cache_bytes.value == 0


class RecordingHistogram:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values.append(value)


def test_a_synthesis_without_audio_is_counted_without_audio_seconds_or_rtf() -> None:
    """A Ray Counter refuses an increment of 0: a request whose LLM stopped at once must not fail on its metrics."""
    ingress = metrics.IngressMetrics.__new__(metrics.IngressMetrics)  # no Ray: the instruments are stand-ins
    ingress.first_chunk, ingress.latency, ingress.real_time_factor = (RecordingHistogram() for _ in range(3))
    ingress.audio_seconds = RecordingCounter()
    ingress.record_synthesis("tts", "stream", first_chunk_s=0.1, latency_s=0.2, audio_s=0.0)
    assert ingress.audio_seconds.calls == [] and ingress.real_time_factor.values == []
    assert ingress.latency.values == [0.2]
    ingress.record_synthesis("tts", "stream", first_chunk_s=0.1, latency_s=0.2, audio_s=0.4)
    assert ingress.audio_seconds.calls == [{"endpoint": "tts", "mode": "stream"}]
    assert ingress.real_time_factor.values == [0.5]


# --- benchmarks -----------------------------------------------------------------------------------------


def test_percentiles_are_ordered() -> None:
    stats = percentiles([0.1, 0.2, 0.3, 5.0])
    assert stats["p50"] <= stats["p95"] <= stats["p99"] <= 5.0 and stats["mean"] == pytest.approx(1.4)
    assert percentiles([]) == {}


def test_cli_bench_sweeps_and_writes_json_and_plots(server: tuple[str, int], tmp_path: Path) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "--url", server[0], "--concurrency", "1", "2", "--requests", "3", "--repeats", "2"]
    assert cli_main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    levels = {(r["mode"], r["concurrency"]): r for r in report["results"]}
    assert set(levels) == {(mode, c) for mode in ("whole", "stream") for c in (1, 2)}
    for result in levels.values():
        assert result["requests"] == 3 and result["errors"] == 0 and result["repeats"] == 2
        assert 0 < result["first_chunk_s"]["p50"] <= result["latency_s"]["p50"] <= result["latency_s"]["p99"]
        assert result["audio_s_per_s"] > 0 and result["real_time_factor"]["p50"] > 0
    for name in ("latency_vs_concurrency.png", "throughput_vs_concurrency.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_baseline_server_serves_the_bench_requests() -> None:
    tts = CosyVoice.load("tiny")
    with TestClient(build_baseline(tts)) as baseline:
        assert baseline.get("/v1/voices").json()["sample_rate"] == tts.sample_rate
        body = {"text": "One sentence. And another one.", "format": "pcm", "seed": 4, **SHORT}
        whole = baseline.post("/v1/tts", json={**body, "stream": False})
        with baseline.stream("POST", "/v1/tts", json={**body, "stream": True}) as response:
            pieces = [piece for piece in response.iter_bytes() if piece]
    assert whole.status_code == 200 and len(whole.content) > 0 and len(whole.content) % 2 == 0
    assert len(pieces) >= 1 and sum(map(len, pieces)) % 2 == 0


def test_each_request_is_counted_once_with_the_status_its_client_got_and_a_cut_stream_as_aborted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from ray.exceptions import RayActorError

    import observability.http as http_observability
    from engine.errors import InvalidInputError
    from serve_app.api import EXCEPTION_HANDLERS, _reject_request_id

    counter = RecordingCounter()
    monkeypatch.setattr(http_observability, "ingress_metrics", lambda: type("M", (), {"requests": counter})())
    app = FastAPI()
    for exception, handler in EXCEPTION_HANDLERS.items():  # the ingress's own error handling
        app.add_exception_handler(exception, handler)
    app.add_middleware(http_observability.RequestObservability, reject=_reject_request_id)

    async def cut_after_first_bytes():
        yield b"audio"
        raise RuntimeError("the decoder failed mid-stream")

    app.get("/ok")(lambda: {"ok": True})
    app.get("/bad")(lambda: (_ for _ in ()).throw(InvalidInputError("a bad value")))
    app.get("/lost")(lambda: (_ for _ in ()).throw(RayActorError()))
    app.get("/cut")(lambda: StreamingResponse(cut_after_first_bytes()))
    with TestClient(app, raise_server_exceptions=False) as client:
        statuses = [client.get(path).status_code for path in ("/ok", "/bad", "/lost")]
        cut = client.get("/cut")
    assert statuses == [200, 400, 503]
    assert cut.status_code == 200 and cut.content == b"audio"  # the status line was sent before the failure
    assert [(c["status_code"], c["outcome"]) for c in counter.calls] == [
        ("200", "complete"),
        ("400", "complete"),
        ("503", "complete"),  # a lost replica: the client's 503, not the 500 the middleware saw before
        ("200", "aborted"),
    ]


def test_decoder_gauges_stay_in_the_scrape_while_idle(client: httpx.Client, server: tuple[str, int]) -> None:
    assert client.get("/v1/voices").status_code == 200  # no synthesis: the decoder only idles
    gauges = (metrics.DECODER_QUEUE_DEPTH, metrics.DECODER_ONGOING, metrics.UTILIZATION_FROM_BUSY_TIME)

    def idle_gauges() -> list[Any] | None:
        samples = _samples(server[1])
        present = all(any(s.name == "ray_" + name and s.value == 0 for s in samples) for name in gauges[:2])
        return samples if present and any(s.name == "ray_" + gauges[2] for s in samples) else None

    poll(idle_gauges, "the idle decoder's gauges")
    time.sleep(IDLE_SCRAPE_GAP_S)  # past the ~30 s after which a gauge that is not set again leaves the scrape
    assert idle_gauges() is not None, "a decoder gauge left the scrape while the replica idled"
