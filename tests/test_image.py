"""The image (Dockerfile) and the manifests that run it agree: the tag the README builds is the one
kuberay/rayservice.yaml, kuberay/model-volume.yaml and ray_cluster.yaml's `docker` section name, and the package's
version; the image installs the `text`, `gpu` and `s3` extras as a non-root user from a CUDA runtime base; the Hugging
Face cache the app args' model id resolves into (the image's HF_HOME) is on the /models volume the image declares and
every manifest mounts. Read from the files only: no docker here."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from engine.loading.model_source import hub_model

ROOT = Path(__file__).resolve().parent.parent
MODELS = "/models"


def _pyproject(pattern: str) -> str:
    """One value of pyproject.toml, by a regex (no tomllib on Python 3.10)."""
    [value] = re.findall(pattern, (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    return value


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _built_tag() -> str:
    """The tag of the README's build command (the one command that builds the image)."""
    [tag] = set(re.findall(r"docker build -t (\S+) \.", (ROOT / "README.md").read_text()))
    return tag


def _rayservice() -> dict:
    return yaml.safe_load((ROOT / "kuberay" / "rayservice.yaml").read_text())


def _cluster() -> dict:
    return yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())


def _download_job() -> dict:
    return next(
        d for d in yaml.safe_load_all((ROOT / "kuberay" / "model-volume.yaml").read_text()) if d["kind"] == "Job"
    )


def _pods(manifest: dict) -> list[dict]:
    config = manifest["spec"]["rayClusterConfig"]
    return [config["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in config["workerGroupSpecs"]]


def test_every_manifest_runs_the_image_the_readme_builds_at_the_package_version() -> None:
    tag = _built_tag()
    version = _pyproject(r'^version = "([^"]+)"$')
    assert tag == f"cosyvoice-serve:{version}"
    assert f"docker build -t {tag} ." in _dockerfile()
    images = [
        c["image"]
        for spec in [*_pods(_rayservice()), _download_job()["spec"]["template"]["spec"]]
        for c in spec["containers"]
    ]
    assert len(images) == 4 and set(images) == {tag}
    cluster = _cluster()
    assert cluster["docker"]["image"] == tag
    assert not any("docker" in node for node in cluster["available_node_types"].values())  # one image everywhere


def test_the_image_installs_the_text_gpu_and_s3_extras_as_a_non_root_user_on_a_cuda_base() -> None:
    dockerfile = _dockerfile()
    [base] = re.findall(r"^ARG CUDA_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert base.startswith("nvidia/cuda:") and "-runtime-" in base
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}$", dockerfile, re.MULTILINE)
    [install] = re.findall(r'pip install "\.\[([a-z0-9,]+)\]"', dockerfile)
    assert set(install.split(",")) == {"text", "gpu", "s3"}  # s3: the cluster profile keeps its voices on S3
    assert "nvidia-ml-py" in _pyproject(r"^gpu = \[(.*)\]$")
    users = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert users and users[-1] not in ("root", "0")
    # every package setuptools installs is copied in
    packages = re.findall(r'"(\w+)\*"', _pyproject(r"^include = \[(.*)\]$"))
    assert "engine" in packages
    for package in packages:
        assert re.search(rf"^COPY .* {package} \./{package}$", dockerfile, re.MULTILINE), package


def test_the_hugging_face_cache_is_on_the_model_volume_in_the_image_and_every_manifest() -> None:
    dockerfile = _dockerfile()
    assert re.search(rf"^VOLUME {MODELS}$", dockerfile, re.MULTILINE) and f"mkdir -p {MODELS}" in dockerfile
    [hf_home] = re.findall(r"^\s+HF_HOME=(\S+)$", dockerfile, re.MULTILINE)
    assert hf_home.startswith(f"{MODELS}/")  # the cache outlives the container, and KubeRay's pods share it
    manifest = _rayservice()
    model = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]["model"]
    assert hub_model(model) is not None  # resolved into that cache
    job = _download_job()["spec"]["template"]["spec"]
    for spec in [*_pods(manifest)[1:], job]:  # the workers run the replicas that load it; the Job fills it
        mounts = [m for c in spec["containers"] for m in c.get("volumeMounts", [])]
        assert [m["mountPath"] for m in mounts] == [MODELS]
        assert not any(e["name"] == "HF_HOME" for c in spec["containers"] for e in c.get("env", []))  # the image's
    cluster = _cluster()
    assert f"--volume {MODELS}:{MODELS}" in cluster["docker"]["run_options"]
    assert "HF_HOME" not in " ".join(cluster["docker"]["run_options"])
    assert any(f"chown 1000:1000 {MODELS}" in c for c in cluster["initialization_commands"])
    assert re.search(r"useradd .*--uid 1000 .*ray", dockerfile)
