"""`cosyvoice-serve run` stops cleanly on SIGTERM, the signal containers and systemd stop services with: a stream
running at that moment completes whole, then Serve and Ray shut down and the process exits 0; on Ctrl-C as soon
as it answers, while its app may still be deploying, even if it was started with SIGINT ignored; and started again
at once on the same port, it comes up though the connections of the stopped one hold the port in TIME_WAIT."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serve.conftest import cli_server

pytestmark = pytest.mark.serve  # starts Ray and a Serve app

REPO = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 120
# ~30 s of speech: the stream is still running when the signal comes
BODY = {
    "text": "A stream that is running when the server is told to stop.",
    "format": "pcm",
    "stream": True,
    "seed": 7,
    "sampling": {"min_token_text_ratio": 100, "max_token_text_ratio": 100},
}


TIME_WAIT = "06"  # the state column of /proc/net/tcp


def sockets_in_time_wait(port: int) -> int:
    """TCP sockets whose local port is `port` and that wait out TIME_WAIT (IPv4, this network namespace)."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    fields = [line.split() for line in lines]
    return sum(1 for row in fields if int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == TIME_WAIT)


def test_sigterm_lets_a_running_stream_finish_exits_0_and_a_restart_at_once_on_its_port_comes_up(
    tmp_path: Path,
) -> None:
    """The stop: a stream running at the signal completes whole, the process exits 0. The restart: the stopped
    server closed the client's kept-alive connection from its side, so that socket waits out TIME_WAIT (a minute) on
    the port when the second server starts, less than a second later; `run`'s port check must not take it for a
    listener (it refused such a restart with 'port ... is in use' for about a minute)."""
    with cli_server(REPO, tmp_path) as (process, url), httpx.Client(base_url=url, timeout=300) as client:
        expected = client.post("/v1/tts", json=BODY).content  # seeded: the same bytes again; kept alive till the stop
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
        stopped_at = time.monotonic()
        output = process.stdout.read().decode()
        assert "stopping" in output and "stopped" in output, output[-3000:]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/healthz", timeout=5)  # nothing listens any more
    port = int(url.rsplit(":", 1)[1])
    assert sockets_in_time_wait(port) > 0, "the stop left no TIME_WAIT socket on the port: the restart proves nothing"
    assert time.monotonic() - stopped_at < 1.0  # the second start follows within a second
    with cli_server(REPO, tmp_path, port=port) as (_, again):
        assert httpx.get(f"{again}/v1/voices", timeout=60).status_code == 200


def test_sigint_as_soon_as_it_answers_stops_it_cleanly_even_started_in_the_background(tmp_path: Path) -> None:
    """The app answers requests before `serve.run` returns (it waits for the app's status): an interrupt then is a
    stop like any other (it was a traceback, with no drain). Started with SIGINT ignored, as a shell starts a
    background job, it still stops on SIGINT (it ignored it)."""
    with cli_server(REPO, tmp_path, sigint_ignored=True) as (process, _):
        process.send_signal(signal.SIGINT)
        assert process.wait(STOP_TIMEOUT_S) == 0
        output = process.stdout.read().decode()
        assert "stopping" in output and "stopped" in output and "Traceback" not in output, output[-3000:]
