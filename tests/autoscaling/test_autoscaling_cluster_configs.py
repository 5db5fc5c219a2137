"""The cluster files (launcher config, KubeRay manifests) validate and agree with the GPU profile's app args."""

from __future__ import annotations

import copy
import json
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
    assert gpus * round(1 / args.decoder.num_gpus) == args.decoder.autoscaling.scaling_rules().highest_ceiling()


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


def test_cluster_setup_downloads_the_model_the_profile_loads() -> None:
    # the `gpu` extra (nvidia-ml-py) is in the image: tests/test_image.py
    commands = " ".join(load_cluster()["setup_commands"])
    assert profile_args().model in commands  # the dir the app args load is what the setup fills


def test_cpu_replicas_ask_for_the_cpu_node_resource() -> None:
    deployments = built_deployments(gpu_profile())
    for name in CPU_DEPLOYMENTS:
        options = deployments[name].ray_actor_options
        assert options["num_gpus"] == 0 and options["resources"][CPU_NODE] > 0, name
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
    model_root = str(Path(profile_args().model).parent)
    for group in (cpu, gpu):
        (mount,) = group["template"]["spec"]["containers"][0]["volumeMounts"]
        (volume,) = group["template"]["spec"]["volumes"]
        assert mount["mountPath"] == model_root and mount["name"] == volume["name"]
        claim = volume["persistentVolumeClaim"]["claimName"]
    volume_docs = list(yaml.safe_load_all((ROOT / "kuberay" / "model-volume.yaml").read_text()))
    pvc = next(d for d in volume_docs if d["kind"] == "PersistentVolumeClaim")
    job = next(d for d in volume_docs if d["kind"] == "Job")
    assert pvc["metadata"]["name"] == claim
    assert Path(profile_args().model).name in str(job["spec"]["template"]["spec"]["containers"][0]["args"])
