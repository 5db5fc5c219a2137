"""Secure by default outside the app: `cosyvoice-serve run` keeps Ray's token auth on, binds Ray's ports (its metrics
included) to loopback with HTTP on loopback, and starts two ingress replicas; the cluster files run Ray with token
auth, keep its dashboard off public interfaces and give the ingress its API keys."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import ray
import yaml

from serve_app import cli, cli_run
from serve_app.args import AppArgs
from serve_app.exposure import RAY_LOOPBACK_ENV, is_loopback, on_every_interface
from serve_app.request_args import API_KEYS_ENV

ROOT = Path(__file__).resolve().parents[2]
KEYS_FILE = "~/.cosyvoice/api_keys"
CPU_NODE = "cpu_node"  # the custom resource of the nodes that run the ingress


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("host", "loopback_env"), [("127.0.0.1", "0"), ("0.0.0.0", None)])
def test_run_leaves_ray_token_auth_on_and_binds_ray_to_loopback_with_http(
    monkeypatch: pytest.MonkeyPatch, host: str, loopback_env: str | None
) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv(RAY_LOOPBACK_ENV, raising=False)
    seen: dict[str, object] = {}

    def fake_init(**kwargs: object) -> None:
        seen["auth_mode"] = os.environ.get("RAY_AUTH_MODE")
        seen["loopback"] = os.environ.get(RAY_LOOPBACK_ENV)
        seen["address"] = kwargs.get("address")
        raise _Stop

    monkeypatch.setattr(ray, "init", fake_init)
    options = cli.parser().parse_args(["run", "--voice-models-dir", "/nonexistent", "--host", host])
    with pytest.raises(_Stop):
        options.handler(options)
    # Unset: Ray 2.60 turns token auth on for the new local cluster it starts. Its node address loopback: every Ray
    # port on loopback (measured: the metrics exporter and two metrics servers were on 0.0.0.0 beside HTTP on loopback).
    assert seen == {"auth_mode": None, "loopback": loopback_env, "address": "local"}


def test_run_starts_two_ingress_replicas_unless_told_otherwise() -> None:
    assert cli_run.deployment_overrides_of({}) == [{"name": "TTSIngress", "num_replicas": 2}]
    encoder = {"name": "Encoder", "ray_actor_options": {"num_cpus": 1}}
    assert cli_run.deployment_overrides_of({"deployments": [encoder]}) == [
        encoder,
        {"name": "TTSIngress", "num_replicas": 2},
    ]
    configured = {"deployments": [{"name": "TTSIngress", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}}]}
    assert cli_run.deployment_overrides_of(configured) == configured["deployments"]
    scaled = {"deployments": [{"name": "TTSIngress", "autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}]}
    assert cli_run.deployment_overrides_of(scaled) == scaled["deployments"]


def test_a_port_on_every_interface_is_told_from_one_on_loopback() -> None:
    with socket.create_server(("0.0.0.0", 0)) as everywhere, socket.create_server(("127.0.0.1", 0)) as loopback:
        ports = {everywhere.getsockname()[1], loopback.getsockname()[1]}
        assert on_every_interface(ports) == {everywhere.getsockname()[1]}


def _profile_args(name: str) -> tuple[AppArgs, str]:
    config = yaml.safe_load((ROOT / "configs" / name).read_text())
    (application,) = config["applications"]
    return AppArgs.model_validate(application["args"]), config["http_options"]["host"]


def test_the_gpu_profile_reads_its_keys_from_the_variable_the_cluster_files_set() -> None:
    args, host = _profile_args("gpu_cluster.yaml")
    assert not is_loopback(host)
    assert not args.security.api_keys  # no key in a file: the ingress reads API_KEYS_ENV
    env = API_KEYS_ENV

    cluster = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    workers = [command for command in cluster["worker_start_ray_commands"] if "ray start" in command]
    assert workers and all(f'{env}="$(cat {KEYS_FILE})"' in command for command in workers)
    assert cluster["file_mounts"][KEYS_FILE] == KEYS_FILE

    manifest = yaml.safe_load((ROOT / "kuberay" / "rayservice.yaml").read_text())
    ingress_groups = [
        group
        for group in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        if CPU_NODE in group["rayStartParams"].get("resources", "")
    ]
    assert ingress_groups
    for group in ingress_groups:
        for container in group["template"]["spec"]["containers"]:
            (variable,) = [item for item in container.get("env", []) if item["name"] == env]
            assert variable["valueFrom"]["secretKeyRef"]["key"] == "keys"


def test_the_launcher_runs_ray_with_token_auth_and_the_dashboard_on_localhost() -> None:
    cluster = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    starts = [
        command
        for command in cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]
        if "ray start" in command
    ]
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token" in command for command in starts)
    assert not any("dashboard-host" in command for command in starts)  # ray start's default: localhost
    assert cluster["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"  # one token on every node


def test_the_rayservice_turns_ray_token_auth_on() -> None:
    manifest = yaml.safe_load((ROOT / "kuberay" / "rayservice.yaml").read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    assert "serviceType" not in cluster["headGroupSpec"]  # the head Service stays ClusterIP: no public dashboard


def test_the_local_profile_serves_on_loopback() -> None:
    _, host = _profile_args("local_cpu.yaml")
    assert is_loopback(host)
