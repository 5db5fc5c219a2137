"""The cluster files (launcher config, KubeRay manifests) validate and agree with the GPU profile's app args."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml

from serve_app.args import AppArgs
from tests.serve.test_serve_configs import built_deployments

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
CPU_NODE = "cpu_node"  # the custom resource of CPU nodes
CPU_DEPLOYMENTS = ("TTSIngress", "Encoder", "DecoderCPU")


def load_cluster() -> dict:
    return yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())


def load_manifest() -> dict:
    manifest = yaml.safe_load((ROOT / "kuberay" / "rayservice.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    return manifest


def gpu_profile() -> dict:
    return yaml.safe_load((ROOT / "configs" / "gpu_cluster.yaml").read_text())


def profile_args() -> AppArgs:
    (application,) = gpu_profile()["applications"]
    return AppArgs.model_validate(application["args"])


def test_cluster_yaml_matches_the_launcher_schema() -> None:
    config = load_cluster()
    jsonschema.validate(config, json.loads(SCHEMA.read_text()))
    assert config["provider"]["type"] == "aws"
    assert config["head_node_type"] in config["available_node_types"]


def test_cluster_yaml_survives_the_launchers_own_preparation() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(load_cluster())))


def test_kuberay_serve_config_is_the_gpu_profile() -> None:
    """One source: `serve deploy configs/gpu_cluster.yaml` and the RayService run the same config."""
    assert yaml.safe_load(load_manifest()["spec"]["serveConfigV2"]) == gpu_profile()


@pytest.mark.parametrize(
    "config",
    [
        "configs/gpu_cluster.yaml",
        "configs/gpu_cluster_cosyvoice2.yaml",
        "configs/gpu_cluster_v1_sft.yaml",
        "configs/serve_config.yaml",
        "kuberay/rayservice.yaml",
    ],
)
def test_the_gpu_fraction_is_the_same_everywhere(config: str) -> None:
    text = (ROOT / config).read_text()
    serve_config = yaml.safe_load(text)
    if "spec" in serve_config:
        serve_config = yaml.safe_load(serve_config["spec"]["serveConfigV2"])
    fraction = built_deployments(serve_config)["Decoder"].ray_actor_options["num_gpus"]
    assert fraction == profile_args().decoder.num_gpus == 0.25


def assert_gpu_slots_fit_the_decoders(gpus: float) -> None:
    """`gpus` at the profile's fraction give exactly the decoder's highest max_replicas: none short, none idle."""
    args = profile_args()
    assert gpus * round(1 / args.decoder.num_gpus) == args.decoder.autoscaling.rules.highest_ceiling()


def test_cluster_nodes_fit_the_decoders_and_keep_cpu_replicas_off_gpus() -> None:
    config = load_cluster()
    workers = {name: spec for name, spec in config["available_node_types"].items() if name != config["head_node_type"]}
    gpu_types = [spec for spec in workers.values() if spec["resources"].get("GPU", 0) > 0]
    cpu_types = [spec for spec in workers.values() if spec["resources"].get("GPU", 0) == 0]
    assert gpu_types and cpu_types
    for spec in workers.values():
        assert 0 <= spec["min_workers"] <= spec["max_workers"] <= config["max_workers"]
    assert config["idle_timeout_minutes"] > 0
    assert_gpu_slots_fit_the_decoders(sum(spec["resources"]["GPU"] * spec["max_workers"] for spec in gpu_types))
    assert all(CPU_NODE in spec["resources"] for spec in cpu_types)
    assert not any(CPU_NODE in spec["resources"] for spec in gpu_types)
    assert config["available_node_types"][config["head_node_type"]]["resources"]["CPU"] == 0


def test_each_worker_downloads_the_hub_id_the_profile_loads_and_its_replicas_read_it_offline() -> None:
    # the `gpu` extra (nvidia-ml-py) is in the image, and its HF_HOME on the model volume: tests/test_image.py
    cluster = load_cluster()
    assert cluster["worker_setup_commands"] == [f"cosyvoice-serve download {profile_args().model}"]
    assert "setup_commands" not in cluster  # the head runs no replica: it needs no model
    [start] = [command for command in cluster["worker_start_ray_commands"] if "ray start" in command]
    assert "HF_HUB_OFFLINE=1" in start.split()  # the replicas inherit ray start's environment


def test_cpu_replicas_ask_for_the_cpu_node_resource() -> None:
    deployments = built_deployments(gpu_profile())
    for name in CPU_DEPLOYMENTS:
        options = deployments[name].ray_actor_options
        assert options.get("num_gpus", 0) == 0 and options["resources"][CPU_NODE] > 0, name  # Ray's default: none
    assert CPU_NODE not in deployments["Decoder"].ray_actor_options.get("resources", {})


def test_rayservice_groups_scale_fit_and_mount_the_model() -> None:
    cluster = load_manifest()["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    groups = {group["groupName"]: group for group in cluster["workerGroupSpecs"]}
    gpu = next(g for g in groups.values() if "nvidia.com/gpu" in str(g["template"]))
    cpu = next(g for g in groups.values() if g is not gpu)
    assert gpu["minReplicas"] == 0 < gpu["maxReplicas"]
    (container,) = gpu["template"]["spec"]["containers"]
    assert_gpu_slots_fit_the_decoders(int(container["resources"]["limits"]["nvidia.com/gpu"]) * gpu["maxReplicas"])
    assert json.loads(json.loads(cpu["rayStartParams"]["resources"]))[CPU_NODE] > 0
    assert "resources" not in gpu["rayStartParams"]
    for group in (cpu, gpu):
        (container,) = group["template"]["spec"]["containers"]
        (mount,) = container["volumeMounts"]
        (volume,) = group["template"]["spec"]["volumes"]
        assert mount["name"] == volume["name"] and mount["readOnly"] is True
        claim = volume["persistentVolumeClaim"]["claimName"]
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]  # the cache the Job filled, no hub
    volume_docs = list(yaml.safe_load_all((ROOT / "kuberay" / "model-volume.yaml").read_text()))
    pvc = next(d for d in volume_docs if d["kind"] == "PersistentVolumeClaim")
    job = next(d for d in volume_docs if d["kind"] == "Job")
    assert pvc["metadata"]["name"] == claim and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    (download,) = job["spec"]["template"]["spec"]["containers"]
    assert download["command"] == ["cosyvoice-serve", "download", profile_args().model]
    assert [m["mountPath"] for m in download["volumeMounts"]] == [mount["mountPath"]]  # where the pods read it


# --- CUDA MPS on GPU nodes (docs/gpu_sharing.md) ----------------------------------------------------------------

MPS_DIRS = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps", "CUDA_MPS_LOG_DIRECTORY": "/tmp/nvidia-mps-log"}
MPS_SWITCH = "COSYVOICE_MPS"
START_DAEMON = "nvidia-cuda-mps-control -d"


def _assigned(command: str) -> dict[str, str]:
    """The CUDA_MPS_* variables a shell command line sets."""
    return dict(re.findall(r"\b(CUDA_MPS_[A-Z_]+)=(\S+)", command))


def _mps_lines(commands: list[str]) -> list[str]:
    return [c for c in commands if "nvidia-cuda-mps-control" in c]


def _gpu_pod_container() -> dict:
    groups = load_manifest()["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    gpu = next(g for g in groups if "nvidia.com/gpu" in str(g["template"]))
    (container,) = gpu["template"]["spec"]["containers"]
    return container


def test_the_launcher_the_manifests_and_the_docs_agree_on_mps() -> None:
    cluster = load_cluster()
    commands = cluster["worker_start_ray_commands"]
    [daemon] = [c for c in commands if START_DAEMON in c]
    [start] = [c for c in commands if "ray start" in c]
    assert commands.index(daemon) < commands.index(start)  # the replicas find the daemon when CUDA starts
    assert _assigned(daemon) == _assigned(start) == MPS_DIRS  # the replicas inherit ray start's environment
    assert f"--env {MPS_SWITCH}=1" in " ".join(cluster["docker"]["run_options"])

    container = _gpu_pod_container()
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env == {**MPS_DIRS, MPS_SWITCH: "1", "HF_HUB_OFFLINE": "1"}
    assert START_DAEMON in " ".join(container["lifecycle"]["postStart"]["exec"]["command"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"  # a whole GPU: the pod runs its own daemon

    [plugin] = yaml.safe_load_all((ROOT / "kuberay" / "device-plugin-mps.yaml").read_text())
    [resource] = yaml.safe_load(plugin["data"]["config"])["sharing"]["mps"]["resources"]
    assert resource == {"name": "nvidia.com/gpu", "replicas": round(1 / profile_args().decoder.num_gpus)}

    docs = (ROOT / "docs" / "gpu_sharing.md").read_text()
    for named in (
        *(f"{name}={value}" for name, value in MPS_DIRS.items()),
        f"{MPS_SWITCH}=1",
        START_DAEMON,
        'nvidia-smi -q | grep -i "compute mode"',
        f"echo get_server_list | CUDA_MPS_PIPE_DIRECTORY={MPS_DIRS['CUDA_MPS_PIPE_DIRECTORY']} nvidia-cuda-mps-control",
        "kuberay/device-plugin-mps.yaml",
        "decoder.mps_thread_share",
    ):
        assert named in docs, named


def _fake_tools(bin_dir: Path, log: Path, gpu: bool) -> None:
    """Stand-ins for `nvidia-smi` (a GPU or none) and `nvidia-cuda-mps-control` (records its calls and MPS env)."""
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nexit {0 if gpu else 9}\n")
    (bin_dir / "nvidia-cuda-mps-control").write_text(
        f'#!/bin/sh\ninput=""\n[ "$1" = -d ] || read -r input\n'
        f'echo "$* $input pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> {log}\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)


@pytest.mark.parametrize(("gpu", "switch", "started"), [(True, "1", True), (True, "0", False), (False, "1", False)])
def test_the_mps_commands_start_the_daemon_on_gpu_nodes_unless_switched_off(
    tmp_path: Path, gpu: bool, switch: str, started: bool
) -> None:
    """The launcher's and the GPU pod's MPS lines, run by a shell against stand-in NVIDIA tools (directories moved
    under tmp_path)."""
    log = tmp_path / "calls"
    _fake_tools(tmp_path / "bin", log, gpu)
    moved = {value: str(tmp_path / Path(value).name) for value in MPS_DIRS.values()}

    def run(command: str, env: dict[str, str]) -> None:
        for value, target in moved.items():
            command = command.replace(value, target)
        path = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
        subprocess.run(["/bin/sh", "-c", command], env={"PATH": path, **env}, check=True, timeout=30)

    for command in _mps_lines(load_cluster()["worker_start_ray_commands"]):
        run(command, {MPS_SWITCH: switch})
    launcher = log.read_text().splitlines()
    assert launcher[0].startswith(" quit pipe=") and launcher[0].endswith(moved["/tmp/nvidia-mps"] + " log=")
    expected = f"-d  pipe={moved['/tmp/nvidia-mps']} log={moved['/tmp/nvidia-mps-log']}"
    assert launcher[1:] == ([expected] if started else [])
    assert all(Path(d).is_dir() for d in moved.values()) is started

    if gpu:  # a GPU pod: the hook runs with the container's env
        log.unlink()
        container = _gpu_pod_container()
        env = {item["name"]: moved.get(item["value"], item["value"]) for item in container["env"]}
        [shell, flag, hook] = container["lifecycle"]["postStart"]["exec"]["command"]
        assert (shell, flag) == ("/bin/sh", "-c")
        run(hook, {**env, MPS_SWITCH: switch})
        assert (log.read_text().splitlines() if log.exists() else []) == ([expected] if started else [])
