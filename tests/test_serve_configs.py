"""The shipped Serve configs: valid for `serve deploy`, their `args` valid for `build_app`, the profiles as promised."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app import app, build_app
from serve_app.args import AppArgs
from serve_app.cli import read_serve_config

CONFIGS = Path(__file__).parent.parent / "configs"


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / name).read_text())


@pytest.mark.parametrize("name", ["serve_config.yaml", "local_cpu.yaml", "gpu_cluster.yaml"])
def test_config_is_a_valid_serve_deploy_config(name: str) -> None:
    config = ServeDeploySchema.model_validate(_load(name))
    (application,) = config.applications
    if application.import_path == "serve_app:build_app":
        args = AppArgs.model_validate(application.args)
        build_app(args)  # binds the deployments; raises on a bad combination
    else:
        assert application.import_path == "serve_app:app"


def test_serve_config_matches_the_default_app() -> None:
    """serve_config.yaml is what `serve build serve_app:app` writes: same deployments and options."""
    (application,) = _load("serve_config.yaml")["applications"]
    written = {d["name"]: d for d in application["deployments"]}
    defaults = AppArgs()
    expected = {"Encoder": defaults.encoder, "Decoder": defaults.decoder, "TTSIngress": defaults.ingress}
    assert set(written) == set(expected)
    for name, stage in expected.items():
        assert written[name]["num_replicas"] == stage.num_replicas
        assert written[name]["ray_actor_options"]["num_cpus"] == stage.num_cpus
    assert written["Decoder"]["max_ongoing_requests"] == defaults.decoder.ongoing_requests_limit
    assert app is not None


def test_gpu_cluster_profile() -> None:
    (application,) = _load("gpu_cluster.yaml")["applications"]
    args = AppArgs.model_validate(application["args"])
    assert args.decoder.dtype == "float16" and 0 < args.decoder.num_gpus < 1
    assert args.decoder.max_batch_size == 4
    assert args.decoder.ongoing_requests_limit >= args.decoder.max_batch_size
    assert args.encoder.num_cpus > 0  # the encoder never asks for a GPU: build_app pins num_gpus 0


def test_local_cpu_profile_needs_no_gpu() -> None:
    application, http_options = read_serve_config(CONFIGS / "local_cpu.yaml")
    args = AppArgs.model_validate(application["args"])
    assert args.decoder.num_gpus == 0 and args.model == "tiny"
    assert http_options["host"] == "127.0.0.1"
