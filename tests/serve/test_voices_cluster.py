"""Voices on a cluster: a local 2-node Ray cluster (`ray.cluster_utils.Cluster`) and a real
S3-protocol server the test starts (moto's server mode over HTTP on 127.0.0.1), which the replicas reach through
s3fs with the AWS_* environment, as on a real cluster.

Two copies of the cluster profile's app (configs/gpu_cluster.yaml: Fun-CosyVoice3-0.5B, voices on S3), its model
swapped for `cosyvoice3-tiny`, share `voices_dir: s3://voices/registry`: "a" (route /a) with its
ingress and encoder on the head node, "b" (route /b) with its ingress and encoder on the worker. Both provision the
voice behind `alloy` from a recording in the bucket. A voice registered through one is spoken through the other;
deleted through the other, it is a 404 on both.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path

import httpx
import numpy as np
import pytest
import ray
import s3fs
import soundfile as sf
import yaml
from ray import serve
from ray.cluster_utils import Cluster
from ray.serve import Application
from ray.util.state import list_actors

from engine.voices.registry import provisioned_voice_id
from serve_app.bench.http_load import free_port
from serve_app.ingress import build_app_with_overrides
from tests.serve.conftest import OBJECT_STORE_BYTES, s3_server, wait_until_healthy

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

SHORT = {"sampling": {"max_token_text_ratio": 3.0}}
NARRATOR = provisioned_voice_id("narrator")
PROFILE = Path(__file__).resolve().parents[2] / "configs" / "gpu_cluster.yaml"


def wav_bytes(seconds: float = 2.0, sample_rate: int = 16000, hz: float = 180.0) -> bytes:
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), sample_rate, format="WAV")
    return buffer.getvalue()


def app_of(node: str, bucket: str) -> Application:
    """configs/gpu_cluster.yaml's app (Fun-CosyVoice3-0.5B, voices on S3) with the tiny v3 model and this test's
    bucket, sized for 2 cores: one replica of each stage, the ingress and the encoder on `node` (their deployments'
    overrides), the decoder on CPU."""
    (application,) = yaml.safe_load(PROFILE.read_text())["applications"]
    args = deepcopy(application["args"])
    assert args["model"].endswith("/Fun-CosyVoice3-0.5B-2512") and args["voices_dir"].startswith("s3://")
    args.update(model="cosyvoice3-tiny", voices_dir=f"{bucket}/registry")
    args["voices"] = [
        {
            "file": f"{bucket}/recordings/narrator.wav",
            "transcript": "Hello there.",
            "id": "narrator",
            "openai_name": "alloy",
        }
    ]
    args["encoder"].update(int8=False)
    args["decoder"].update(num_gpus=0, num_cpus=0.3, dtype="float32")
    del args["decoder"]["autoscaling"]  # one replica, whatever the hour of the profile's schedule
    args["decoder_cpu"]["enabled"] = False
    on_node = {"num_cpus": 0.1, "resources": {node: 1}}
    deployments = [
        {"name": "TTSIngress", "num_replicas": 1, "ray_actor_options": on_node},
        {"name": "Encoder", "num_replicas": 1, "ray_actor_options": on_node},
    ]
    return build_app_with_overrides(args, deployments)


@pytest.fixture(scope="module")
def urls() -> Iterator[tuple[str, str]]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with s3_server() as bucket:  # first: the nodes inherit its AWS_* environment
        s3fs.S3FileSystem(skip_instance_cache=True).pipe_file(
            f"{bucket.removeprefix('s3://')}/recordings/narrator.wav", wav_bytes()
        )
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "resources": {"node_a": 10}, "object_store_memory": OBJECT_STORE_BYTES},
        )
        try:
            cluster.add_node(num_cpus=2, resources={"node_b": 10}, object_store_memory=OBJECT_STORE_BYTES)
            ray.init(address=cluster.address, log_to_driver=False)
            port = free_port()
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
            serve.run(app_of("node_a", bucket), name="a", route_prefix="/a")
            serve.run(app_of("node_b", bucket), name="b", route_prefix="/b")
            base = f"http://127.0.0.1:{port}"
            for prefix in ("/a", "/b"):
                wait_until_healthy(base + prefix, timeout_s=120.0)  # two apps on 2 shared cores
            yield base + "/a", base + "/b"
        finally:
            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()


def encoder_nodes() -> dict[str, str]:
    actors = list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("state", "=", "ALIVE")],
        limit=1000,
        raise_on_missing_output=False,
    )
    return {
        name.split("::")[1].split("#")[0]: actor.node_id
        for actor in actors
        if "#Encoder#" in (name := actor.name or "")
    }


def speak(url: str, voice: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/tts", json={"text": "Hello.", "voice": voice, "format": "wav", **SHORT}, timeout=300)


def test_the_encoders_run_on_different_nodes(urls: tuple[str, str]) -> None:
    nodes = encoder_nodes()
    assert set(nodes) == {"a", "b"} and nodes["a"] != nodes["b"], nodes


def test_alloy_is_provisioned_once_for_both(urls: tuple[str, str]) -> None:
    for url in urls:
        speech = {"model": "tts-1", "input": "Hi.", "voice": "alloy", "response_format": "wav"}
        response = httpx.post(f"{url}/v1/audio/speech", json=speech, timeout=300)
        assert response.status_code == 200, response.text
        assert httpx.get(f"{url}/v1/voices").json()["openai_voices"]["alloy"] == NARRATOR
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    assert sorted(path.rsplit("/", 1)[-1] for path in fs.find("voices/registry")) == [
        f"{NARRATOR}.json",
        f"{NARRATOR}.npz",
    ]


def test_register_through_one_speak_through_the_other_delete_everywhere(urls: tuple[str, str]) -> None:
    url_a, url_b = urls
    response = httpx.post(
        f"{url_a}/v1/voices",
        files={"file": ("me.wav", wav_bytes(hz=220.0), "audio/wav")},
        data={"transcript": "Hi there."},
        timeout=300,
    )
    assert response.status_code == 201, response.text
    voice = response.json()["id"]
    assert voice in [record["id"] for record in httpx.get(f"{url_b}/v1/voices").json()["registered_voices"]]
    spoken = speak(url_b, voice)
    assert spoken.status_code == 200, spoken.text
    assert speak(url_a, voice).status_code == 200  # and through the one that registered it
    deleted = httpx.delete(f"{url_b}/v1/voices/{voice}", timeout=60)
    assert deleted.status_code == 200, deleted.text
    for url in urls:
        gone = speak(url, voice)
        assert gone.status_code == 404 and "unknown voice" in gone.json()["error"]["message"], gone.text
        assert httpx.delete(f"{url}/v1/voices/{voice}", timeout=60).status_code == 404
        assert voice not in [record["id"] for record in httpx.get(f"{url}/v1/voices").json()["registered_voices"]]
