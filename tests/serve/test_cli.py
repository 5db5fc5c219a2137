"""The CLI before any server: it starts without torch or Ray, and `run` refuses a busy port, or Wyoming beside API
keys without `--wyoming-allow-keyless`, at once."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.args import AppArgs
from serve_app.bench.http_load import free_port
from serve_app.cli import main as cli_main
from serve_app.cli import parser
from serve_app.cli_client import API_KEY_ENV
from serve_app.cli_run import URL_ENV, port_in_use, startup_warnings
from serve_app.exposure import RAY_LOOPBACK_ENV


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


def test_the_port_check_passes_a_stopped_servers_time_wait_sockets_but_not_a_listener() -> None:
    """A server's listener has SO_REUSEADDR (Serve's proxy, uvicorn), so the connections it closed first leave
    TIME_WAIT sockets that a plain bind still counts as the port in use, but the proxy's own bind does not."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its socket on `port` goes to TIME_WAIT
            assert client.recv(1) == b""
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # the TIME_WAIT socket is there
    assert not port_in_use("127.0.0.1", port)


def test_the_client_commands_take_the_server_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parser().parse_args(["say", "Hi."]).url == "http://127.0.0.1:8000"
    monkeypatch.setenv(URL_ENV, "http://127.0.0.1:8123")
    assert parser().parse_args(["say", "Hi."]).url == "http://127.0.0.1:8123"
    assert parser().parse_args(["voices", "list"]).url == "http://127.0.0.1:8123"
    assert parser().parse_args(["bench"]).url == "http://127.0.0.1:8123"
    assert parser().parse_args(["say", "Hi.", "--url", "http://h:1"]).url == "http://h:1"


def test_the_example_client_streams_to_the_servers_url(monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(__file__).parents[2] / "examples" / "stream_text_ws.py"
    spec = importlib.util.spec_from_file_location("stream_text_ws_url", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # its dataclasses look their module up
    spec.loader.exec_module(example)
    assert example.stream_url("http://127.0.0.1:8123") == "ws://127.0.0.1:8123/v1/audio/speech/stream"
    assert example.stream_url("https://tts.example/") == "wss://tts.example/v1/audio/speech/stream"
    assert example.stream_url("ws://h:1/v1/audio/speech/stream") == "ws://h:1/v1/audio/speech/stream"
    with pytest.raises(ValueError, match="ftp://h"):
        example.stream_url("ftp://h")


def test_bad_app_args_stop_plan_with_one_line_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--llm-checkpoint", "../llm.pt"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: llm_checkpoint: String should match pattern")


def test_run_refuses_wyoming_beside_api_keys_unless_allowed_and_on_a_busy_port(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(RAY_LOOPBACK_ENV, raising=False)  # `run` sets it before it would start Ray: undone after
    monkeypatch.setenv("COSYVOICE_API_KEYS", "sk-in-the-environment")
    run = ["run", "--port", str(free_port())]
    assert cli_main([*run, "--wyoming-port", str(free_port())]) == 2
    assert "Wyoming has no authentication and this server has API keys" in capsys.readouterr().err
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        assert cli_main([*run, "--wyoming-port", str(busy), "--wyoming-allow-keyless"]) == 2
    assert f"Wyoming port {busy} is in use on 127.0.0.1" in capsys.readouterr().err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    # Keys in the app args (a Serve config's, for `serve deploy`) are refused as the args are read.
    with pytest.raises(ValueError, match=r"set wyoming\.allow_keyless"):
        AppArgs.model_validate({"security": {"api_keys": ["sk-configured"]}, "wyoming": {"port": 10200}})


def test_run_warns_of_wyoming_beyond_loopback_and_not_on_loopback() -> None:
    beyond = startup_warnings({"wyoming": {"port": 10200, "host": "0.0.0.0"}}, "127.0.0.1", environ={})
    assert any("Wyoming on 0.0.0.0:10200, beyond loopback, has no authentication" in line for line in beyond)
    on_loopback = startup_warnings({"wyoming": {"port": 10200}}, "127.0.0.1", environ={})
    assert not any("Wyoming" in line for line in on_loopback)
