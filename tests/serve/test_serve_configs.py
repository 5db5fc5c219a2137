"""The shipped Serve configs: valid for `serve deploy`, their `args` valid for `build_app`, autoscaling in force."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve._private.build_app import build_app as build_deployments
from ray.serve.schema import ServeDeploySchema

from autoscaling.policy import DECODER_POLICY_PATH
from serve_app import build_app
from serve_app.args import AppArgs
from serve_app.cli_run import read_serve_config
from serve_app.full_config import render

CONFIGS = Path(__file__).parents[2] / "configs"
CONFIG_NAMES = sorted(path.name for path in CONFIGS.glob("*.yaml"))


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / name).read_text())


def built_deployments(config: dict[str, Any]) -> dict[str, Any]:
    """The deployments `serve deploy` of `config` runs: the app its args build, with the file's overrides."""
    (application,) = ServeDeploySchema.model_validate(config).applications
    assert application.import_path == "serve_app:build_app"
    built = {d.name: d for d in build_deployments(build_app(application.args), name=application.name).deployments}
    for override in application.deployments:
        options = override.model_dump(exclude_unset=True, exclude={"name"})
        built[override.name] = built[override.name].options(**options)
    return built


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_config_deploys_the_autoscaling_policies(name: str) -> None:
    deployments = built_deployments(_load(name))
    decoder = deployments["Decoder"]._deployment_config.autoscaling_config
    assert decoder is not None and decoder.policy.policy_function == DECODER_POLICY_PATH
    encoder = deployments["Encoder"]._deployment_config.autoscaling_config
    assert encoder is not None and encoder.policy.is_default_policy_function()  # Serve's queue-based policy
    assert encoder.max_replicas > encoder.min_replicas


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_long_streams_outlast_a_replica_shutdown(name: str) -> None:
    (application,) = _load(name)["applications"]
    max_stream_s = AppArgs.model_validate(application["args"]).limits.max_stream_s
    for deployment_name, deployment in built_deployments(_load(name)).items():
        if deployment_name != "Encoder":  # the encoder answers in one call; the others hold streams
            assert deployment._deployment_config.graceful_shutdown_timeout_s >= max_stream_s, deployment_name


def test_serve_config_is_the_gpu_profile_spelled_out() -> None:
    """serve_config.yaml is what `python -m serve_app.full_config configs/gpu_cluster.yaml` writes today."""
    expected = render(_load("gpu_cluster.yaml"), "configs/gpu_cluster.yaml")
    assert (CONFIGS / "serve_config.yaml").read_text() == expected


def test_gpu_cluster_profile() -> None:
    (application,) = _load("gpu_cluster.yaml")["applications"]
    args = AppArgs.model_validate(application["args"])
    # Fun-CosyVoice3-0.5B by its hub id (no allowed_model_roots: they admit directories only, docs/deploy.md), each
    # module's dtype chosen at load (bfloat16 LLM and flow), voices in a shared store
    assert args.model == "FunAudioLLM/Fun-CosyVoice3-0.5B-2512" and args.security.allowed_model_roots is None
    assert args.decoder.dtype == "auto" and 0 < args.decoder.num_gpus < 1
    assert args.voices_dir is not None and args.voices_dir.startswith("s3://")
    assert args.decoder.max_batch_size == 4
    decoder = built_deployments(_load("gpu_cluster.yaml"))["Decoder"]  # its max_ongoing_requests: the deployments'
    assert decoder.max_ongoing_requests >= args.decoder.batches_fill_at
    rules = args.decoder.autoscaling.rules
    assert rules.lowest_floor() == 0 and args.decoder_cpu.enabled  # a night at 0 GPUs, served by the fallback


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("gpu_cluster_cosyvoice2.yaml", "FunAudioLLM/CosyVoice2-0.5B"),
        ("gpu_cluster_v1_sft.yaml", "FunAudioLLM/CosyVoice-300M-SFT"),
    ],
)
def test_the_alternative_profiles_are_the_gpu_profile_with_another_model(name: str, model: str) -> None:
    (application,) = _load(name)["applications"]
    (profile,) = _load("gpu_cluster.yaml")["applications"]
    args, profile_args = application["args"], dict(profile["args"])
    assert args["model"] == model and args["decoder"]["dtype"] == "float16"
    assert application["deployments"] == profile["deployments"]  # Serve's options, the same on the same cluster
    for key in ("model", "voices_dir"):
        profile_args.pop(key)
    args = {key: value for key, value in args.items() if key != "model"}
    assert args == {**profile_args, "decoder": {**profile_args["decoder"], "dtype": "float16"}}


def test_local_cpu_profile_needs_no_gpu() -> None:
    application, http_options = read_serve_config(CONFIGS / "local_cpu.yaml")
    args = AppArgs.model_validate(application["args"])
    assert args.decoder.num_gpus == 0 and args.model == "tiny"
    assert http_options["host"] == "127.0.0.1"
