"""Request guard (API keys, body limit, voice names), model-path confinement, 503 mapping and decoder routing,
without Ray Serve running."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from pydantic import ValidationError
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from autoscaling.policy import WAKE_HOLD_S, MemoryWakeBoard, ScalingRules, WakeRule
from autoscaling.schedule import Schedule
from engine.errors import InvalidInputError
from serve_app import routing
from serve_app.args import AppArgs
from serve_app.errors import error_body, error_response
from serve_app.guard import GuardSettings, RequestGuard, check_voice_name, load_api_keys
from serve_app.request_args import SecurityArgs
from serve_app.routing import CPU_DECODER, ENCODER, GPU_DECODER, DecoderRouter, choose_decoder
from tests.serve.conftest import healthz_routes

KEY = "k-0123456789abcdef"
LIMIT = 64


@pytest.fixture
def guarded() -> Iterator[httpx.AsyncClient]:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"size": len(await request.body())}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    settings = GuardSettings(api_keys=(KEY.encode(), b"other-key"), max_body_bytes=LIMIT)
    app.add_middleware(RequestGuard, error_body=error_body, settings=settings)
    yield httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_keys_are_required_everywhere_but_healthz(guarded: httpx.AsyncClient) -> None:
    async def calls() -> list[httpx.Response]:
        async with guarded as client:
            return [
                await client.post("/echo", content=b"{}"),
                await client.post("/echo", content=b"{}", headers={"Authorization": "Bearer wrong"}),
                await client.post("/echo", content=b"{}", headers={"Authorization": f"Basic {KEY}"}),
                await client.post("/echo", content=b"{}", headers={"Authorization": f"Bearer {KEY}"}),
                await client.post("/echo", content=b"{}", headers={"authorization": "bearer other-key"}),
                await client.get("/healthz"),
            ]

    missing, wrong, basic, good, second, health = _run(calls())
    for rejected in (missing, wrong, basic):
        assert rejected.status_code == 401
        assert rejected.headers["www-authenticate"] == "Bearer"
        assert rejected.json()["error"]["code"] == "invalid_api_key"
    assert good.status_code == second.status_code == health.status_code == 200
    assert good.json() == {"size": 2}


def test_body_over_the_limit_is_413_declared_or_streamed(guarded: httpx.AsyncClient) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(LIMIT):  # no content-length: the guard must count what arrives
            yield b"xx"

    async def calls() -> list[httpx.Response]:
        async with guarded as client:
            return [
                await client.post("/echo", content=b"x" * (LIMIT + 1), headers=auth),
                await client.post("/echo", content=chunks(), headers=auth),
                await client.post("/echo", content=b"x" * LIMIT, headers=auth),
            ]

    declared, streamed, at_limit = _run(calls())
    for response in (declared, streamed):
        assert response.status_code == 413
        assert str(LIMIT) in response.json()["error"]["message"]
    assert at_limit.status_code == 200 and at_limit.json() == {"size": LIMIT}


def test_api_keys_from_config_and_environment() -> None:
    security = SecurityArgs(api_keys=("from-config",))
    environ = {"COSYVOICE_API_KEYS": " env-1, ,env-2 ", "COSYVOICE_ADMIN_KEYS": "admin"}
    assert load_api_keys(security, environ) == (b"from-config", b"env-1", b"env-2")
    assert load_api_keys(SecurityArgs(), {}) == ()
    assert "from-config" not in repr(security) and "from-config" not in str(AppArgs(security=security))


def test_a_validation_error_does_not_echo_the_keys() -> None:
    with pytest.raises(ValidationError) as info:
        AppArgs.model_validate({"model": "../up", "security": {"api_keys": [KEY]}})
    assert KEY not in str(info.value) and "'..'" in str(info.value)


@pytest.mark.parametrize("voice", ["", "../spk", "a/b", "a\\b", "..", ".", "x\x00y", "tab\tname", "v" * 129])
def test_unsafe_voice_names_are_rejected(voice: str) -> None:
    with pytest.raises(InvalidInputError, match="invalid voice name"):
        check_voice_name(voice)


@pytest.mark.parametrize("voice", ["中文女", "dummy_female", "speaker 1", "a.b"])
def test_ordinary_voice_names_pass(voice: str) -> None:
    check_voice_name(voice)


def test_model_dir_must_stay_inside_the_allowed_roots(tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "good").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "link").symlink_to(outside)  # a symlink inside the root that points out of it
    roots = {"allowed_model_roots": [str(root)]}
    AppArgs(model=str(root / "good"), security=roots)
    AppArgs(model="tiny", security=roots)  # presets are not paths
    for escaping in (str(outside), str(root / "link"), str(root / "good" / ".." / ".." / "elsewhere")):
        with pytest.raises(ValidationError, match=r"outside the allowed model roots|must not contain"):
            AppArgs(model=escaping, security=roots)
    with pytest.raises(ValidationError, match="must not contain"):
        AppArgs(model="models/../../etc")


def test_serve_overload_and_replica_loss_become_json_503s_with_retry_after() -> None:
    overload = error_response(
        BackPressureError(num_queued_requests=3, max_queued_requests=3, retry_after_s=2.5), "req-1"
    )
    assert overload.status_code == 503 and overload.headers["retry-after"] == "3"
    assert b"at capacity" in overload.body and b"server_error" in overload.body
    lost = error_response(ActorDiedError(), "req-2")
    assert lost.status_code == 503 and lost.headers["retry-after"] == "1"
    assert b"replica failed" in lost.body and b"req-2" in lost.body


@pytest.mark.parametrize(
    ("running", "expected"),
    [
        ({GPU_DECODER: 2, CPU_DECODER: 1}, GPU_DECODER),
        ({GPU_DECODER: 1, CPU_DECODER: 0}, GPU_DECODER),
        ({GPU_DECODER: 0, CPU_DECODER: 1}, CPU_DECODER),
        ({GPU_DECODER: 0, CPU_DECODER: 0}, GPU_DECODER),  # its queue makes Serve cold-start a replica
        ({}, GPU_DECODER),
    ],
)
def test_routing_rule(running: dict[str, int], expected: str) -> None:
    assert choose_decoder(running) == expected


@pytest.mark.parametrize(
    ("running", "expected"),
    [
        ({GPU_DECODER: 2, CPU_DECODER: 1}, CPU_DECODER),  # drained before its policy takes it to 0
        ({GPU_DECODER: 0, CPU_DECODER: 1}, CPU_DECODER),  # no request queues at the GPU decoder: no cold start
        ({GPU_DECODER: 1, CPU_DECODER: 0}, GPU_DECODER),  # the fallback is not up (yet): keep serving
        ({GPU_DECODER: 0, CPU_DECODER: 0}, GPU_DECODER),  # nothing runs: Serve cold-starts the GPU decoder
    ],
)
def test_routing_rule_while_the_gpu_floor_is_zero(running: dict[str, int], expected: str) -> None:
    assert choose_decoder(running, draining=True) == expected


def test_router_drains_the_gpu_decoder_while_its_schedule_floor_is_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    async def both_running(app_name: str, names) -> dict[str, int]:
        return {ENCODER: 1, GPU_DECODER: 1, CPU_DECODER: 1}

    monkeypatch.setattr(routing, "running_replicas", both_running)
    night = ScalingRules(min_replicas=0, schedule=Schedule())  # the floor is 0 all day

    async def choice(rules: ScalingRules | None) -> object:
        router = DecoderRouter({GPU_DECODER: "gpu", CPU_DECODER: "cpu"}, poll_interval_s=60, gpu_rules=rules)
        await router.refresh("app")
        return router.handle()

    assert _run(choice(night)) == "cpu"
    assert _run(choice(ScalingRules(min_replicas=1, schedule=Schedule()))) == "gpu"  # floor 1: no drain
    assert _run(choice(None)) == "gpu"  # a fixed-size GPU decoder is never drained


def test_wake_rule_waits_the_first_audio_slo() -> None:
    autoscaled = {"decoder": {"autoscaling": {}}, "scheduler": {"target_first_audio_s": 2.5}}
    rule = AppArgs(**autoscaled, decoder_cpu={"enabled": True}).wake_rule()
    assert rule == WakeRule(wait_s=2.5, hold_s=WAKE_HOLD_S, queued=1.0) and rule.hold_s == 900
    queued = AppArgs(**autoscaled, decoder_cpu={"enabled": True, "wake_queued": 4}).wake_rule()
    assert queued == WakeRule(wait_s=2.5, queued=4.0)
    assert AppArgs(**autoscaled, decoder_cpu={"enabled": True, "wake": False}).wake_rule() is None
    assert AppArgs(**autoscaled).wake_rule() is None  # no fallback
    assert AppArgs(decoder_cpu={"enabled": True}).wake_rule() is None  # a fixed-size GPU decoder
    with pytest.raises(ValidationError, match=r"wake_wait_s was removed: derived: scheduler\.target_first_audio_s"):
        AppArgs(decoder_cpu={"enabled": True, "wake_wait_s": 0.5})


def test_router_sends_new_work_to_a_woken_gpu_decoder_once_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {ENCODER: 1, GPU_DECODER: 0, CPU_DECODER: 1}

    async def polled(app_name: str, names) -> dict[str, int]:
        return dict(counts)

    monkeypatch.setattr(routing, "running_replicas", polled)
    board = MemoryWakeBoard()
    night = ScalingRules(min_replicas=0, schedule=Schedule())  # the floor is 0 all day
    router = DecoderRouter(
        {GPU_DECODER: "gpu", CPU_DECODER: "cpu"}, poll_interval_s=60, gpu_rules=night, wake_board=board
    )

    def choice() -> object:
        _run(router.refresh("app"))
        return router.handle()

    board.wake("app", time.time() + 3600)
    assert choice() == "cpu"  # woken, but the GPU replica does not run yet: the fallback keeps serving
    counts[GPU_DECODER] = 1
    assert choice() == "gpu"
    board.wake("app", time.time() - 1)  # the hold is over: drained to the fallback again
    assert choice() == "cpu"


def test_router_follows_the_polled_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    # One scripted answer per poll, handed over one at a time; a failed read must keep the last decision.
    script: list[dict[str, int] | Exception] = [
        {GPU_DECODER: 1, CPU_DECODER: 1},
        RuntimeError("controller busy"),
        {GPU_DECODER: 0, CPU_DECODER: 1},
        {GPU_DECODER: 0, CPU_DECODER: 0},
    ]
    gpu, cpu = object(), object()

    async def scenario() -> list[object]:
        answers: asyncio.Queue[dict[str, int] | Exception] = asyncio.Queue()
        calls = 0

        async def fake_running(app_name: str, names) -> dict[str, int]:
            nonlocal calls
            assert app_name == "app" and set(names) == {ENCODER, GPU_DECODER, CPU_DECODER}
            calls += 1
            answer = await answers.get()
            if isinstance(answer, Exception):
                raise answer
            return answer

        monkeypatch.setattr(routing, "running_replicas", fake_running)
        router = DecoderRouter({GPU_DECODER: gpu, CPU_DECODER: cpu}, poll_interval_s=0.001)
        router.start("app")
        seen = []
        for index, answer in enumerate(script):
            answers.put_nowait(answer)
            while calls < index + 2:  # the next poll began: the one that got `answer` is done
                await asyncio.sleep(0.001)
            seen.append(router.handle())
        return seen

    assert _run(scenario()) == [gpu, gpu, cpu, gpu]


def test_router_without_fallback_keeps_the_gpu_decoder_and_does_not_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = 0

    async def only_encoder(app_name: str, names) -> dict[str, int]:
        nonlocal reads
        reads += 1
        assert set(names) == {ENCODER, GPU_DECODER}  # the encoder too: /healthz reads this view
        return {ENCODER: 1, GPU_DECODER: 0}

    monkeypatch.setattr(routing, "running_replicas", only_encoder)

    async def scenario() -> tuple[object, int, dict[str, int]]:
        router = DecoderRouter({GPU_DECODER: "gpu"}, poll_interval_s=0.001)
        router.start("app")
        await asyncio.sleep(0.05)  # fifty poll intervals
        reads_while_idle = reads
        await router.refresh_if_older("app", max_age_s=1.0)  # what /healthz does
        return router.handle(), reads_while_idle, router.running

    assert _run(scenario()) == ("gpu", 0, {ENCODER: 1, GPU_DECODER: 0})


def test_healthz_rereads_a_view_older_than_a_second_whatever_it_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import ray.serve

    from serve_app.health_routes import HEALTH_MAX_AGE_S

    reads = 0

    def serving(views: list[dict[str, int]]):
        async def fake_running(app_name: str, names) -> dict[str, int]:
            nonlocal reads
            reads += 1
            return views[min(reads, len(views)) - 1]

        return fake_running

    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(app_name="app"))

    async def probes(views: list[dict[str, int]]) -> list[int]:
        nonlocal reads
        reads = 0
        monkeypatch.setattr(routing, "running_replicas", serving(views))
        router = DecoderRouter({GPU_DECODER: "gpu"}, poll_interval_s=3600)  # no poll during the probes
        await router.refresh("app")
        routes = healthz_routes(router)
        router.polled_at -= 2 * HEALTH_MAX_AGE_S
        return [(await routes.healthz()).status_code for _ in range(5)]

    # a view that predates the start is re-read once; the fresh one serves the probes of the next second
    assert _run(probes([{ENCODER: 0, GPU_DECODER: 1}, {ENCODER: 1, GPU_DECODER: 1}])) == [200] * 5
    assert reads == 2
    # a ready view is re-read too: a replica that died since (its actor gone) turns the probe to 503 at once
    assert _run(probes([{ENCODER: 1, GPU_DECODER: 1}, {ENCODER: 1, GPU_DECODER: 0}])) == [503] * 5
    assert reads == 2


def test_a_replica_whose_actor_is_gone_is_not_counted_as_running(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import ray

    status = SimpleNamespace(
        applications={
            "app": SimpleNamespace(
                deployments={
                    "Encoder": SimpleNamespace(replica_states={"RUNNING": 1}),
                    "Decoder": SimpleNamespace(replica_states={"RUNNING": 2}),  # the controller has not noticed yet
                }
            )
        }
    )
    actors = [{"name": "SERVE_REPLICA::app#Encoder#a1"}, {"name": "SERVE_REPLICA::app#Decoder#d1"}]
    actors.append({"name": "SERVE_REPLICA::other#Decoder#x"})  # another app's
    monkeypatch.setattr(routing.serve, "status", lambda: status)
    monkeypatch.setattr(ray.util, "list_named_actors", lambda all_namespaces: actors)
    counts = _run(routing.running_replicas("app", ("Encoder", "Decoder", "DecoderCPU")))
    assert counts == {"Encoder": 1, "Decoder": 1, "DecoderCPU": 0}
