"""The cluster-launcher config and the KubeRay RayService manifest parse, validate and match the policy."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import ray.autoscaler
import yaml
from ray.serve._private.build_app import build_app as build_deployments
from ray.serve.schema import ServeDeploySchema

from autoscaling.policy import (
    CPU_FALLBACK_POLICY_PATH,
    ENCODER_AUTOSCALING_CONFIG,
    cpu_fallback_autoscaling_config,
    decoder_autoscaling_config,
)
from serve_app import build_app
from serve_app.args import AppArgs

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = Path(ray.autoscaler.__file__).parent / "ray-schema.json"


def load_cluster() -> dict:
    return yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())


def load_serve_config() -> dict:
    manifest = yaml.safe_load((ROOT / "kuberay" / "rayservice.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def test_cluster_yaml_matches_the_launcher_schema() -> None:
    config = load_cluster()
    jsonschema.validate(config, json.loads(SCHEMA.read_text()))
    assert config["provider"]["type"] == "aws"
    assert config["head_node_type"] in config["available_node_types"]


def test_cluster_yaml_survives_the_launchers_own_preparation() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(load_cluster())))


def test_cluster_has_cpu_and_gpu_worker_types_with_bounds() -> None:
    config = load_cluster()
    workers = {name: spec for name, spec in config["available_node_types"].items() if name != config["head_node_type"]}
    gpu_types = [spec for spec in workers.values() if spec["resources"].get("GPU", 0) > 0]
    cpu_types = [spec for spec in workers.values() if spec["resources"].get("GPU", 0) == 0]
    assert gpu_types and cpu_types
    for spec in workers.values():
        assert 0 <= spec["min_workers"] <= spec["max_workers"] <= config["max_workers"]
    assert config["idle_timeout_minutes"] > 0
    # enough GPU slots for the decoder's max_replicas at the serve config's fractional GPU
    decoder = deployment(load_serve_config(), "Decoder")
    per_gpu = round(1 / decoder["ray_actor_options"]["num_gpus"])
    gpus = sum(spec["max_workers"] * spec["resources"]["GPU"] for spec in gpu_types)
    assert gpus * per_gpu >= decoder["autoscaling_config"]["max_replicas"]


def deployment(serve_config: dict, name: str) -> dict:
    (app,) = serve_config["applications"]
    return next(d for d in app["deployments"] if d["name"] == name)


def test_rayservice_serve_config_validates_and_uses_the_policies() -> None:
    serve_config = load_serve_config()
    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] == "serve_app:build_app"
    assert deployment(serve_config, "Decoder")["autoscaling_config"] == decoder_autoscaling_config()
    assert deployment(serve_config, "DecoderCPU")["autoscaling_config"] == cpu_fallback_autoscaling_config()
    assert deployment(serve_config, "Encoder")["autoscaling_config"] == ENCODER_AUTOSCALING_CONFIG


def test_rayservice_gpu_group_can_reach_zero_and_back() -> None:
    manifest = yaml.safe_load((ROOT / "kuberay" / "rayservice.yaml").read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    groups = {group["groupName"]: group for group in cluster["workerGroupSpecs"]}
    gpu = next(g for g in groups.values() if "nvidia.com/gpu" in str(g["template"]))
    assert gpu["minReplicas"] == 0 < gpu["maxReplicas"]


def test_rayservice_args_build_the_app_its_overrides_describe() -> None:
    """The overrides name deployments the args really build (DecoderCPU included), with the same resources."""
    serve_config = load_serve_config()
    (app,) = serve_config["applications"]
    args = AppArgs.model_validate(app["args"])
    assert args.decoder_cpu.enabled
    built = {d.name: d for d in build_deployments(build_app(args), name=app["name"]).deployments}
    for override in app["deployments"]:
        assert override["name"] in built
    gpu, cpu = deployment(serve_config, "Decoder"), deployment(serve_config, "DecoderCPU")
    assert gpu["ray_actor_options"]["num_gpus"] == args.decoder.num_gpus > 0  # the replica decides fp16 from it
    assert cpu["ray_actor_options"] == {"num_cpus": args.decoder_cpu.num_cpus}
    assert cpu["max_ongoing_requests"] == args.decoder_cpu.max_ongoing_requests
    assert built["DecoderCPU"].ray_actor_options["num_gpus"] == 0
    policy = built["DecoderCPU"]._deployment_config.autoscaling_config.policy
    assert policy.policy_function == CPU_FALLBACK_POLICY_PATH
