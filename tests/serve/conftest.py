"""Shared helpers of the serving tests: the real application on one small local Ray (Serve on a free 127.0.0.1
port), the CLI server, audio files (reading responses back, every format but pcm through FFmpeg, PyAV; writing small
uploads that decode to much more audio), and a bound on a block's time and peak memory."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import ray
import soundfile as sf
import websockets
from ray import serve

from engine.voices.registry import EVERYONE, VoiceRegistryFullError
from serve_app.bench.http_load import free_port
from serve_app.ingress import build_app_with_overrides

OBJECT_STORE_BYTES = 256 * 2**20  # the default (30% of RAM) is far more than the tiny model needs
READY_TIMEOUT_S = 60.0
CLI_START_TIMEOUT_S = 300.0  # `cosyvoice-serve run`: Ray, three deployments and the model loads, on 2 shared CPUs


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.25) -> None:
    """Poll `condition()` until it is true; fail (never hang) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)


def wait_until_healthy(base_url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait for /healthz to answer 200, as a load balancer's readiness probe would: `serve.run` returns once the
    replicas run, but the ingress's polled view of them may still be one poll interval old."""
    healthy = lambda: httpx.get(f"{base_url}/healthz", timeout=10).status_code == 200  # noqa: E731
    wait_until(healthy, timeout_s, "/healthz to answer 200", interval_s=0.1)


def on_cpus(**num_cpus: float) -> list[dict[str, Any]]:
    """Deployment overrides that reserve `num_cpus` for each replica of the deployments named (TTSIngress=0.1, ...):
    the apps of a test fit a 2-CPU Ray."""
    return [{"name": name, "ray_actor_options": {"num_cpus": cpus}} for name, cpus in num_cpus.items()]


@contextmanager
def running_app(
    app_args: dict[str, Any],
    app_name: str,
    host: str = "127.0.0.1",
    deployments: Sequence[Mapping[str, Any]] = (),
    **ray_options: Any,
) -> Iterator[str]:
    """`app_args` with the Serve config's `deployments` overrides served at route "/" on a 2-CPU Ray, HTTP on `host`
    (a loopback address); yields the base URL, shuts both down after."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a new local Ray would otherwise want a token
    # address="local": a new Ray of our own, even while another process runs a cluster on this machine.
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=OBJECT_STORE_BYTES,
        log_to_driver=False,
        **ray_options,
    )
    try:
        port = free_port()
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app_with_overrides(app_args, deployments), name=app_name, route_prefix="/")
        base_url = f"http://{host}:{port}"
        wait_until_healthy(base_url)
        yield base_url
    finally:
        serve.shutdown()
        ray.shutdown()


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


@contextmanager
def s3_server(bucket: str = "voices") -> Iterator[str]:
    """A real S3-protocol server (moto's server mode, over HTTP on a free 127.0.0.1 port) with one empty `bucket`;
    yields the bucket's URL (`s3://voices`). The environment points S3 clients at it while it runs (set it before a
    Ray starts: its workers inherit it), as an operator's would at an S3-compatible store."""
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    httpx.post(f"http://127.0.0.1:{port}/moto-api/reset", timeout=10)  # moto keeps its state per process, not server
    saved = {key: os.environ.get(key) for key in (*S3_ENV, "AWS_ENDPOINT_URL_S3")}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{port}")
    try:
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        yield f"s3://{bucket}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def answers_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def cli_server(
    checkout: Path, home: Path, sigint_ignored: bool = False, port: int | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`cosyvoice-serve run` of the code in `checkout`, in a process of its own, for a user whose home is `home` ->
    (process, URL) once its /healthz answers 200; killed on leaving if it still runs. Fails, the process killed, if
    it exits first or is not healthy within CLI_START_TIMEOUT_S. `sigint_ignored`: started as a shell starts a
    background job, SIGINT ignored. `port`: default a free one."""
    port = port or free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("XDG_DATA_HOME", "RAY_ADDRESS")}
    env |= {"HOME": str(home), "PYTHONPATH": str(checkout), "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "serve_app.cli", "run", "--port", str(port)]
    process = subprocess.Popen(
        command,
        cwd=checkout,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=partial(signal.signal, signal.SIGINT, signal.SIG_IGN) if sigint_ignored else None,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + CLI_START_TIMEOUT_S
    while not answers_healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            output = process.communicate()[0].decode()[-3000:]
            raise AssertionError(f"the server did not come up (exit code {process.returncode}): {output}")
        time.sleep(2)
    try:
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


@contextmanager
def bounded_in_time_and_memory(max_s: float, max_growth_bytes: int) -> Iterator[None]:
    """Fails unless the block ends within `max_s` and its peak resident memory stays under `max_growth_bytes` above
    the memory at its start (writing 5 to clear_refs resets the peak, VmHWM, to the current VmRSS)."""
    Path("/proc/self/clear_refs").write_text("5")
    before, start = _status_bytes("VmRSS"), time.monotonic()
    yield
    elapsed, growth = time.monotonic() - start, _status_bytes("VmHWM") - before
    assert elapsed < max_s, f"took {elapsed:.1f} s"
    assert growth < max_growth_bytes, f"peak memory grew by {growth / 2**20:.0f} MiB"


TEXT_STREAM_PATH = "/v1/audio/speech/stream"


async def text_stream_exchange(
    base_url: str, messages: list[str | dict[str, Any]], timeout_s: float = 60.0
) -> tuple[list[dict[str, Any]], bytes, int | None]:
    """A text stream session (`/v1/audio/speech/stream`) that sends `messages` (a str as it is: raw JSON, possibly
    malformed) and reads until the server closes -> (its JSON events, its audio, the close code)."""
    events: list[dict[str, Any]] = []
    audio = bytearray()
    async with websockets.connect(base_url.replace("http://", "ws://", 1) + TEXT_STREAM_PATH) as ws:
        for message in messages:
            await ws.send(message if isinstance(message, str) else json.dumps(message))
        try:
            while True:
                frame = await asyncio.wait_for(ws.recv(), timeout_s)
                if isinstance(frame, bytes):
                    audio += frame
                else:
                    events.append(json.loads(frame))
        except websockets.ConnectionClosed as closed:
            return events, bytes(audio), closed.rcvd.code if closed.rcvd else None


def decode_audio_file(data: bytes) -> tuple[np.ndarray, int]:
    """A wav, flac, mp3, opus or aac file -> (float32 mono samples, sample rate)."""
    with av.open(io.BytesIO(data)) as container:
        rate = container.streams.audio[0].rate
        frames = [frame.to_ndarray() for frame in container.decode(audio=0)]
    samples = np.concatenate([frame.reshape(-1) if frame.shape[0] == 1 else frame[0] for frame in frames])
    if samples.dtype.kind in "iu":
        samples = samples / np.iinfo(samples.dtype).max
    return samples.astype(np.float32), rate


def constant_flac(seconds: float, channels: int, sample_rate: int = 16000) -> bytes:
    """A FLAC file of a constant signal: it compresses to almost nothing (600 s x 8 channels: ~80 KB)."""
    buffer = io.BytesIO()
    block = np.full((1 << 20, channels), 0.25, dtype=np.float32)
    with sf.SoundFile(buffer, "w", sample_rate, channels, format="FLAC", subtype="PCM_16") as sound:
        for start in range(0, int(seconds * sample_rate), len(block)):
            sound.write(block[: int(seconds * sample_rate) - start])
    return buffer.getvalue()


def concurrent_adds(registries: list[Any], prompt: Callable[[int], Any], attempts: int, timeout_s: float) -> list[str]:
    """`attempts` registrations at once, spread over `registries` (replicas sharing one store): "added" or "full"
    (VoiceRegistryFullError) for each."""
    outcomes: list[str] = []

    def add(index: int) -> None:
        try:
            registries[index % len(registries)].add(prompt(index), None, duration_s=1.0, caller=EVERYONE)
            outcomes.append("added")
        except VoiceRegistryFullError:
            outcomes.append("full")

    threads = [threading.Thread(target=add, args=(index,)) for index in range(attempts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s)
    return outcomes


def healthz_routes(router: Any, serving_warnings: tuple[str, ...] = ()) -> Any:
    """The health route group around `router`: its serving warnings, no text relay made yet, the default limits, and
    no Wyoming listener."""
    from types import SimpleNamespace

    from deployments.text_relay import TextRelays
    from serve_app.health_routes import HealthRoutes
    from serve_app.request_args import LimitsArgs

    return HealthRoutes(SimpleNamespace(router=router, limits=LimitsArgs()), serving_warnings, TextRelays())


def model_info(**fields: Any) -> Any:
    """The `ModelInfo` of the tiny v1 model (with neither speakers nor cloning), with `fields` instead."""
    from deployments.encoder import ModelInfo

    tiny = {
        "model": "tiny",
        "family": "CosyVoice v1",
        "version": 1,
        "instructions": "none",
        "streaming": True,
        "streaming_speed": True,
        "bistream": False,
        "voices": (),
        "sample_rate": 22050,
        "speech_tokens_per_s": 50,
        "voice_cloning": False,
        "llm_checkpoint": None,
        "default_voice": None,
        "languages": (),
    }
    return ModelInfo(**tiny | fields)
