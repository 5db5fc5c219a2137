"""The CLI before any server: it starts without torch or Ray, and `run` refuses a busy port at once."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from benchmarks.http_bench import free_port
from serve_app.cli import API_KEY_ENV, parser
from serve_app.cli import main as cli_main


def test_the_cli_imports_neither_torch_nor_ray() -> None:
    check = "import sys, serve_app.cli; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("option", ["--port", "--metrics-port"])
def test_run_refuses_a_busy_port_before_starting_ray(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        other = ["--port", str(free_port())] if option == "--metrics-port" else []
        assert cli_main(["run", *other, option, str(busy)]) == 2
    assert f"{busy} is in use on 127.0.0.1; pass {option}" in capsys.readouterr().err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_say_and_bench_take_the_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    assert parser().parse_args(["say", "Hi."]).api_key == "sk-from-env"
    assert parser().parse_args(["bench", "--api-key", "sk-given"]).api_key == "sk-given"
