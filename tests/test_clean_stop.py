"""`cosyvoice-serve run` stops cleanly on SIGTERM, the signal containers and systemd stop services with: a stream
running at that moment completes whole, then Serve and Ray shut down and the process exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.http_bench import free_port

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300  # Ray, three deployments and the model loads, on 2 shared CPUs
STOP_TIMEOUT_S = 120
# ~30 s of speech: the stream is still running when the signal comes
BODY = {
    "text": "A stream that is running when the server is told to stop.",
    "format": "pcm",
    "stream": True,
    "seed": 7,
    "sampling": {"min_token_text_ratio": 100, "max_token_text_ratio": 100},
}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_sigterm_lets_a_running_stream_finish_then_exits_0(tmp_path: Path) -> None:
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("XDG_DATA_HOME", "RAY_ADDRESS")}
    env |= {"HOME": str(tmp_path), "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "serve_app.cli", "run", "--port", str(port)]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            assert process.poll() is None, process.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, f"not healthy within {START_TIMEOUT_S} s"
            time.sleep(2)
        expected = httpx.post(f"{url}/v1/tts", json=BODY, timeout=300).content  # seeded: the same bytes again
        assert len(expected) > 0

        received: list[bytes] = []
        first_bytes = threading.Event()

        def listen() -> None:
            with httpx.stream("POST", f"{url}/v1/tts", json=BODY, timeout=300) as response:
                assert response.status_code == 200
                for piece in response.iter_raw():
                    received.append(piece)
                    first_bytes.set()

        listener = threading.Thread(target=listen)
        listener.start()
        assert first_bytes.wait(120), "no audio before the signal"
        process.send_signal(signal.SIGTERM)
        listener.join(STOP_TIMEOUT_S)
        assert not listener.is_alive()
        assert b"".join(received) == expected  # the stream ran to its end, though the server was stopping
        assert process.wait(STOP_TIMEOUT_S) == 0
        output = process.stdout.read().decode()
        assert "stopping" in output and "stopped" in output, output[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/healthz", timeout=5)  # nothing listens any more
