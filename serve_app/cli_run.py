"""`cosyvoice-serve run`: a local Ray and the app on it. The Serve config's application and HTTP options with the
command line's options over them, the checks before Ray starts (ports, the model, Wyoming), the plan for this machine,
the addresses it serves on, and the drained stop on Ctrl-C or SIGTERM. `plan` and `normalize` read the Serve config
and report errors as `run` does, with the helpers here.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from engine.errors import CosyVoiceError
from engine.loading.model_source import model_directory, served_name
from engine.voices.spec import CAMPPLUS_FILE

if TYPE_CHECKING:
    from serve_app.args import AppArgs
    from serve_app.inventory import Inventory
    from serve_app.plan import Device

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
DEFAULT_INGRESS_REPLICAS = 2
URL_ENV = "COSYVOICE_URL"  # the server `say`, `voices` and `bench` talk to (and the examples)


def read_serve_config(path: Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(application entry, http_options) of a Serve config file's first application (its `args` and `deployments`
    overrides are what `run` serves); defaults without one."""
    if path is None:
        return {"name": "cosyvoice", "route_prefix": "/", "args": {}}, {}
    config = yaml.safe_load(path.read_text()) or {}
    applications = config.get("applications") or []
    if not applications:
        raise SystemExit(f"{path} has no applications")
    return applications[0], config.get("http_options") or {}


def default_voices_dir(model: str, environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """The per-user place of the registered voices of `model` (XDG data dir); one folder per model, since a voice
    is prepared for its model's sample rate and speech tokens."""
    data_home = Path(environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return data_home / "cosyvoice-serve" / "voices" / Path(model).name


def with_default_voices_dir(args: dict[str, Any]) -> dict[str, Any]:
    """`args` with a per-user `voices_dir` when none is set and the model has cloning models (a tiny preset ships
    them; an official dir holds campplus.onnx), so that the default server clones voices with no flags."""
    from serve_app.args import AppArgs

    if args.get("voices_dir") is not None:
        return args
    models = AppArgs.model_validate(args).voice_models_source
    if models is None or not (model_directory(models) / CAMPPLUS_FILE).is_file():
        return args
    return {**args, "voices_dir": str(default_voices_dir(args.get("model", "tiny")))}


def startup_warnings(args: dict[str, Any], host: str, environ: Mapping[str, str] = os.environ) -> list[str]:
    """What is unsafe in how `run` is about to serve: Ray's token auth turned off, HTTP beyond loopback without
    API keys (the replicas of this local cluster read the keys from this same environment), Wyoming (which has no
    authentication) beyond loopback or beside API keys."""
    from serve_app.args import AppArgs
    from serve_app.guard import keys_configured, load_api_keys, serving_warnings

    warnings = []
    if environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        warnings.append(
            "RAY_AUTH_MODE=disabled: Ray's own ports (GCS, raylet, workers) take calls without authentication, so "
            "anyone who can reach them (every user of this machine; with HTTP beyond loopback, the network) can run "
            "code in it; unset it to keep Ray's token auth on"
        )
    app_args = AppArgs.model_validate(args)
    security = app_args.security
    warnings += serving_warnings(security, host, bool(load_api_keys(security, dict(environ))))
    warnings += app_args.wyoming.serving_warnings(keys_configured(security, environ))
    return warnings


def with_wyoming_options(args: dict[str, Any], options: argparse.Namespace) -> dict[str, Any]:
    """`args` with the command line's Wyoming options over the `wyoming` section of the config's app args."""
    given = {"port": options.wyoming_port, "host": options.wyoming_host, "allow_keyless": options.wyoming_allow_keyless}
    given = {key: value for key, value in given.items() if value not in (None, False)}
    return {**args, "wyoming": {**(args.get("wyoming") or {}), **given}} if given else args


def wyoming_refusal(args: AppArgs, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why `run` cannot serve Wyoming as asked (None where it can, or Wyoming is off): its port is taken, or the server
    has API keys (in the app args, or in this environment, which the local replicas share) and Wyoming, which has no
    authentication, was not allowed without them."""
    from serve_app.guard import keys_configured

    wyoming = args.wyoming
    if wyoming.port is None:
        return None
    if port_in_use(wyoming.host, wyoming.port):
        return f"Wyoming port {wyoming.port} is in use on {wyoming.host}; pass --wyoming-port with a free one"
    return wyoming.keyless_refusal(keys_configured(args.security, environ))


def run(options: argparse.Namespace) -> int:
    application, http_options = read_serve_config(options.config)
    args = app_args_of(application, options)
    for key in ("voices_dir", "voice_models_dir"):
        if getattr(options, key) is not None:
            args[key] = str(getattr(options, key))
    args = with_wyoming_options(args, options)
    host = options.host or http_options.get("host", DEFAULT_HOST)
    port = options.port or int(http_options.get("port", DEFAULT_PORT))
    for what, number, option in (("port", port, "--port"), ("metrics port", options.metrics_port, "--metrics-port")):
        if number is not None and port_in_use(host, number):
            print(f"error: {what} {number} is in use on {host}; pass {option} with a free one", file=sys.stderr)
            return 2
    from serve_app.exposure import RAY_LOOPBACK_ENV, is_loopback

    if is_loopback(host):  # every Ray port (GCS, raylet, workers, metrics) on loopback too, unless the env says not
        os.environ.setdefault(RAY_LOOPBACK_ENV, "0")  # before Ray is imported: it reads it then
    try:
        # A hub id first, before torch is imported: its download, or at once its one-line refusal
        model_directory(args.get("model", "tiny"))
        # Imported here so that `say` stays light; Ray and the app only once the model is there.
        from serve_app.args import AppArgs
        from serve_app.ingress import build_app_with_overrides

        app_args = AppArgs.model_validate(args)
        deployments = deployment_overrides_of(application)  # imports Ray: after its loopback setting above
        build_app_with_overrides(app_args, deployments)  # its deployment overrides checked before Ray starts
        refusal = wyoming_refusal(app_args)
        if refusal is not None:
            print(f"error: {refusal}", file=sys.stderr)
            return 2
        model_line = fetch_model(app_args)
    except (ValueError, CosyVoiceError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"error: {error_line(exc)}", file=sys.stderr)
        return 2
    print(model_line, flush=True)
    args = with_default_voices_dir(args)
    import ray
    from ray import serve

    from serve_app.ingress import SHUTDOWN_MARGIN_S
    from serve_app.inventory import inventory_here

    for warning in startup_warnings(args, host):
        print(f"warning: {warning}", file=sys.stderr)
    # Our own Ray, not a cluster another process started. Its token auth stays on (a new local cluster gets a token,
    # ~/.ray/auth_token): any local user reaches loopback ports, and beyond loopback Ray's are on every interface.
    ray.init(address="local", include_dashboard=False, _metrics_export_port=options.metrics_port)
    # Ctrl-C and SIGTERM (containers, systemd) stop the server: drained, then Serve and Ray shut down, exit 0; also
    # while the app deploys (it answers requests before `serve.run` returns, which waits for its status). Set after
    # `ray.init`, which sets a SIGTERM handler that exits at once; SIGINT too, because a shell starts a background
    # job with SIGINT ignored and Python then leaves it ignored.
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, _interrupt)
    resources = ray.cluster_resources()
    try:
        inventory = inventory_here(int(resources.get("GPU", 0)), resources["CPU"])
        args, deployments = follow_plan(args, deployments, options.device, inventory)
    except (ValueError, CosyVoiceError) as exc:  # PlanError, a ValueError
        print(f"error: {error_line(exc)}", file=sys.stderr)
        ray.shutdown()
        return 2
    name = application.get("name", "cosyvoice")
    serving = False
    try:
        serve.start(http_options={"host": host, "port": port})
        serving = True
        serve.run(
            build_app_with_overrides(args, deployments), name=name, route_prefix=application.get("route_prefix", "/")
        )
        url = f"http://{host}:{port}"
        print(f"cosyvoice-serve is up at {url} (model: {served_name(args.get('model', 'tiny'))}); Ctrl-C stops it")
        print(f"  export {URL_ENV}={url}   # for cosyvoice-serve say / voices / bench and the examples")
        print('  cosyvoice-serve say "Hello from CosyVoice." -o out.wav')
        print(f"  curl {url}/v1/voices")
        print(f"metrics (Prometheus): http://{host}:{metrics_port()}/metrics")
        if args.get("voices_dir"):
            print(f"registered voices are kept in {args['voices_dir']}")
        wyoming = AppArgs.model_validate(args).wyoming
        if wyoming.port is not None:
            print(f"Wyoming (Home Assistant's Wyoming integration): host {wyoming.host}, port {wyoming.port}")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        if serving:  # the app may be taking requests, even while it deploys
            drain_s = AppArgs.model_validate(args).limits.max_stream_s + SHUTDOWN_MARGIN_S
            print(f"stopping: new requests are refused; the running ones may finish (up to {drain_s:g} s)", flush=True)
            drain(name, drain_s)
    finally:
        serve.shutdown()
        ray.shutdown()
    print("stopped", flush=True)
    return 0


def error_line(exc: Exception) -> str:
    """One line for an error `run` or `plan` stops on: a CosyVoiceError's message, or each message of pydantic's
    ValidationError (the app args) with the field it names; else the exception's text."""
    from pydantic import ValidationError

    if isinstance(exc, CosyVoiceError):
        return exc.message
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(map(str, error['loc']))}: {error['msg']}" if error["loc"] else error["msg"]
            for error in exc.errors()
        )
    return str(exc)


def app_args_of(application: dict[str, Any], options: argparse.Namespace) -> dict[str, Any]:
    """The app args of a Serve config's application with the command line's model and LLM checkpoint over them."""
    args = dict(application.get("args") or {})
    if options.model is not None:
        args["model"] = options.model
    if options.llm_checkpoint is not None:
        args["llm_checkpoint"] = options.llm_checkpoint
    return args


def deployment_overrides_of(application: dict[str, Any]) -> list[dict[str, Any]]:
    """The `deployments:` overrides of a Serve config's application, with two ingress replicas where they give no
    count: a lost one then costs its own requests, not an outage (one alone: the first 200 came 26 s after it was
    killed)."""
    from serve_app.deployment_options import INGRESS, with_options

    deployments = list(application.get("deployments") or [])
    ingress = next((entry for entry in deployments if entry.get("name") == INGRESS), {})
    if {"num_replicas", "autoscaling_config"} & ingress.keys():
        return deployments
    return with_options(deployments, INGRESS, {"num_replicas": DEFAULT_INGRESS_REPLICAS})


def follow_plan(
    args: dict[str, Any], deployments: list[dict[str, Any]], device: Device, inventory: Inventory
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`args` with the decoder section, and `deployments` with the overrides, of the plan for `inventory` (printed),
    with the footprints the GPU check recorded; PlanError where the machine cannot."""
    from engine.loading.loader import model_sizes
    from serve_app.args import AppArgs
    from serve_app.footprints import recorded_footprints
    from serve_app.plan import plan_for

    app_args = AppArgs.model_validate(args)
    plan = plan_for(inventory, model_sizes(app_args.model), app_args, device, recorded_footprints(), deployments)
    print("\n".join(plan.lines()), flush=True)
    return {**args, "decoder": plan.decoder_args}, plan.deployments


def fetch_model(args: AppArgs) -> str:
    """Make the app's model ready before Ray starts: a hub id is downloaded here, in the foreground with its progress
    bar (the replicas then find it in the cache), and a model dir is checked as the replicas will load it; -> the line
    `run` prints of it (where it is, which LLM checkpoint). A CosyVoiceError, one line, where it cannot be had."""
    from engine.loading.loader import locate_model

    load_format, config_path, llm_file = locate_model(args.model, None, args.llm_checkpoint)
    if load_format == "dummy":
        return f"model {args.model}: seeded random weights ({config_path.name})"
    return f"model {served_name(args.model)} from {config_path.parent}, LLM checkpoint {llm_file}"


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on `port` (checked before Ray starts, which would fail 20 s later). The probe
    binds as Serve's proxy and Ray's metrics server do, with SO_REUSEADDR: the TIME_WAIT sockets a stopped server's
    connections leave for a minute do not stop them binding, while a listener does (without SO_REUSEPORT, which
    would share the port with a running proxy)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def metrics_port() -> int:
    """The port of this node's Prometheus metrics (Ray's agent serves every replica's metrics there)."""
    import ray

    return int(ray.nodes()[0]["MetricsExportPort"])


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def drain(app_name: str, timeout_s: float) -> bool:
    """Delete the application and wait until it is gone: Serve routes no new request to it (its route answers 404)
    while each replica finishes its ongoing requests within its graceful shutdown timeout. -> whether it went in
    time (else what still runs is stopped by the shutdown that follows)."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    serve.delete(app_name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app_name)
        if status is None or status.status == ApplicationStatus.NOT_STARTED:
            return True
        time.sleep(0.5)
    return False
