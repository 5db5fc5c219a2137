"""Console entry point `cosyvoice-serve`.

cosyvoice-serve run [--model DIR|ID|PRESET] [--config FILE]   start a local Ray and the app (tiny model by default)
                    [--wyoming-port 10200]                also the Wyoming protocol, for Home Assistant
cosyvoice-serve plan [--model M] [--gpus N --gpu-memory-gb G] [--json]   what runs where on this machine
cosyvoice-serve download ID                            download a hub model into its cache
cosyvoice-serve say "text" -o out.wav                  synthesise through a running server
cosyvoice-serve bench [--url URL] [--out DIR]           HTTP load benchmark (see serve_app/bench/http_load.py)
cosyvoice-serve voices add FILE --transcript TEXT | list | rm ID   registered voices of a running server
cosyvoice-serve normalize TEXT [--model M] [--language L]   what the model reads of TEXT (no server)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from engine.errors import CosyVoiceError
from engine.loading.model_source import model_directory, served_name
from engine.voices.spec import CAMPPLUS_FILE
from serve_app.bench.http_load import auth_headers
from serve_app.bench.timing import add_repeat_options

if TYPE_CHECKING:
    from serve_app.args import AppArgs
    from serve_app.plan import Device, Inventory

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
DEFAULT_INGRESS_REPLICAS = 2
API_KEY_ENV = "COSYVOICE_API_KEY"  # the key `say` and `bench` send to a server with API keys
URL_ENV = "COSYVOICE_URL"  # the server `say`, `voices` and `bench` talk to (and the examples)


def default_server_url(environ: Mapping[str, str] = os.environ) -> str:
    """The client commands' server: $COSYVOICE_URL, else the address `run` serves on by default."""
    return environ.get(URL_ENV) or f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"


def read_serve_config(path: Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(application entry, http_options) of a Serve config file's first application; defaults without one."""
    if path is None:
        return {"name": "cosyvoice", "route_prefix": "/", "args": {}}, {}
    config = yaml.safe_load(path.read_text()) or {}
    applications = config.get("applications") or []
    if not applications:
        raise SystemExit(f"{path} has no applications")
    application = applications[0]
    if application.get("deployments"):
        print(
            f"note: `run` applies only the `args` of {path}; for its deployment overrides use `serve run {path}`",
            file=sys.stderr,
        )
    return application, config.get("http_options") or {}


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

        app_args = AppArgs.model_validate(args)
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

    from serve_app.ingress import SHUTDOWN_MARGIN_S, build_app
    from serve_app.plan import inventory_here

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
        args = follow_plan(args, options.device, inventory_here(int(resources.get("GPU", 0)), resources["CPU"]))
    except (ValueError, CosyVoiceError) as exc:  # PlanError, a ValueError
        print(f"error: {error_line(exc)}", file=sys.stderr)
        ray.shutdown()
        return 2
    name = application.get("name", "cosyvoice")
    serving = False
    try:
        serve.start(http_options={"host": host, "port": port})
        serving = True
        serve.run(build_app(args), name=name, route_prefix=application.get("route_prefix", "/"))
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
    """The app args of a Serve config's application with the command line's model and LLM checkpoint over them, and
    two ingress replicas where they give no number: a lost one then costs its own requests, not an outage (one
    alone: the first 200 came 26 s after it was killed)."""
    args = dict(application.get("args") or {})
    args["ingress"] = {"num_replicas": DEFAULT_INGRESS_REPLICAS, **(args.get("ingress") or {})}
    if options.model is not None:
        args["model"] = options.model
    if options.llm_checkpoint is not None:
        args["llm_checkpoint"] = options.llm_checkpoint
    return args


def follow_plan(args: dict[str, Any], device: Device, inventory: Inventory) -> dict[str, Any]:
    """`args` with the decoder section of the plan for `inventory` (printed), with the footprints the GPU check
    recorded; PlanError where the machine cannot."""
    from engine.loading.loader import model_sizes
    from serve_app.args import AppArgs
    from serve_app.plan import plan_for, recorded_footprints

    app_args = AppArgs.model_validate(args)
    plan = plan_for(inventory, model_sizes(app_args.model), app_args, device, recorded_footprints())
    print("\n".join(plan.lines()), flush=True)
    return {**args, "decoder": plan.decoder_args}


def show_plan(options: argparse.Namespace) -> int:
    """`cosyvoice-serve plan`: the plan for this machine, or for one described by --gpus and --gpu-memory-gb."""
    from engine.loading.loader import model_sizes
    from serve_app.args import AppArgs
    from serve_app.plan import Gpu, inventory_here, plan_for, recorded_footprints

    application, _ = read_serve_config(options.config)
    if options.gpus and options.gpu_memory_gb is None:
        print("error: --gpus needs --gpu-memory-gb (each card's memory)", file=sys.stderr)
        return 2
    inventory = inventory_here(cpus=options.cpus)
    if options.gpus is not None:
        card = Gpu(options.gpu_name, int((options.gpu_memory_gb or 0) * 2**30), not options.no_native_bfloat16)
        inventory = replace(inventory, gpus=(card,) * options.gpus)
    try:
        app_args = AppArgs.model_validate(app_args_of(application, options))
        plan = plan_for(inventory, model_sizes(app_args.model), app_args, options.device, recorded_footprints())
    except (ValueError, CosyVoiceError) as exc:
        print(f"error: {error_line(exc)}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json(), indent=2) if options.json else "\n".join(plan.lines()))
    return 0


def fetch_model(args: AppArgs) -> str:
    """Make the app's model ready before Ray starts: a hub id is downloaded here, in the foreground with its progress
    bar (the replicas then find it in the cache), and a model dir is checked as the replicas will load it; -> the line
    `run` prints of it (where it is, which LLM checkpoint). A CosyVoiceError, one line, where it cannot be had."""
    from engine.loading.loader import locate_model

    load_format, config_path, llm_file = locate_model(args.model, None, args.llm_checkpoint)
    if load_format == "dummy":
        return f"model {args.model}: seeded random weights ({config_path.name})"
    return f"model {served_name(args.model)} from {config_path.parent}, LLM checkpoint {llm_file}"


def download(options: argparse.Namespace) -> int:
    """Resolve a hub model into its cache (what `run` and every replica do): the step a cluster's nodes run first."""
    try:
        directory = model_directory(options.model)
    except CosyVoiceError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    print(directory)
    return 0


def normalize(options: argparse.Namespace) -> int:
    """`cosyvoice-serve normalize`: the segments the model reads of a text after normalisation, each with the language
    it was read as; from the model's config and tokenizer alone (no server, no weights)."""
    from engine.loading.loader import load_frontend
    from serve_app.args import AppArgs

    application, _ = read_serve_config(options.config)
    args = dict(application.get("args") or {})
    if options.model is not None:
        args["model"] = options.model
    try:
        app_args = AppArgs.model_validate(args)
        frontend = load_frontend(
            app_args.model,
            max_text_chars=app_args.limits.max_input_chars,
            spell_out_languages=app_args.text.spell_out_languages,
        )
        segments = frontend.split_by_language(options.text, options.language)
    except (ValueError, CosyVoiceError) as exc:
        print(f"error: {error_line(exc)}", file=sys.stderr)
        return 2
    for language, segment in segments:
        print(f"[{language or 'as written'}] {segment}")
    return 0


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


def error_message(response: httpx.Response) -> str:
    """An API error's message (OpenAI's shape), else the body's text."""
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text


def voices(options: argparse.Namespace) -> int:
    """`voices add` registers a recording, `voices list` prints the voices, `voices rm` deletes one."""
    try:
        with httpx.Client(base_url=options.url, timeout=options.timeout, headers=auth_headers(options.api_key)) as http:
            if options.action == "add":
                try:
                    audio = options.file.read_bytes()
                except OSError as exc:
                    print(f"error: cannot read {options.file}: {exc.strerror}", file=sys.stderr)
                    return 1
                form = {"transcript": options.transcript, "shared": str(options.shared).lower()}
                for field in ("name", "openai_name"):
                    if getattr(options, field) is not None:
                        form[field] = getattr(options, field)
                response = http.post("/v1/voices", data=form, files={"file": (options.file.name, audio)})
            elif options.action == "list":
                response = http.get("/v1/voices")
            else:
                response = http.delete(f"/v1/voices/{options.voice_id}")
    except httpx.HTTPError as exc:
        print(f"error: cannot reach {options.url}: {exc}", file=sys.stderr)
        return 1
    if response.status_code not in (200, 201):
        print(f"error {response.status_code}: {error_message(response)}", file=sys.stderr)
        return 1
    body = response.json()
    if options.action == "add":
        print(f"registered {body['id']} ({body['name']}, {body['duration_s']:.1f} s); use it as the voice")
    elif options.action == "list":
        print("built-in: " + (", ".join(body["voices"]) or "none"))
        for record in body["registered_voices"]:
            shared = ", shared" if record.get("shared") else ""
            openai_name = f", openai_name {record['openai_name']}" if record.get("openai_name") else ""
            duration = f"{record['duration_s']:.1f} s"
            print(f"{record['id']}  {record['name']} ({duration}{shared}{openai_name}): {record['transcript']}")
    else:
        print(f"deleted {body['id']}")
    return 0


def say(options: argparse.Namespace) -> int:
    body: dict[str, Any] = {"text": options.text, "format": options.format, "stream": options.stream}
    for key in ("voice", "instruct_text", "seed", "speed"):
        if getattr(options, key) is not None:
            body[key] = getattr(options, key)
    headers = auth_headers(options.api_key)
    try:
        with (
            httpx.Client(base_url=options.url, timeout=options.timeout, headers=headers) as client,
            client.stream("POST", "/v1/tts", json=body) as response,
        ):
            if response.status_code != 200:
                response.read()
                print(f"error {response.status_code}: {error_message(response)}", file=sys.stderr)
                return 1
            with open(options.output, "wb") as out:
                for piece in response.iter_bytes():
                    out.write(piece)
    except httpx.HTTPError as exc:
        print(f"error: cannot reach {options.url}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {options.output}")
    return 0


def bench(options: argparse.Namespace) -> int:
    from serve_app.bench.http_load import Workload
    from serve_app.bench.http_load import bench as run_bench

    workload = Workload(
        concurrencies=tuple(options.concurrency),
        modes=tuple(options.modes),
        requests_per_level=options.requests,
        max_token_text_ratio=options.max_token_text_ratio or None,
        timeout_s=options.timeout,
        repeats=options.repeats,
        warmup=options.warmup,
    )
    report = run_bench(options.url, workload, options.out, model=options.model, api_key=options.api_key)
    errors = sum(result["errors"] for result in report["results"])
    print(f"wrote {options.out / 'bench.json'} and {', '.join(report['plots'])}; {errors} error(s)")
    return 0 if errors == 0 else 1


def add_api_key_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"sent as a bearer token to a server with API keys (default: ${API_KEY_ENV})",
    )


def add_device_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the decoders run: auto (the GPUs Ray sees, else CPU), cpu, or cuda (refused without a GPU)",
    )


def add_url_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--url",
        default=default_server_url(),
        help=f"the server (default: ${URL_ENV}, else http://{DEFAULT_HOST}:{DEFAULT_PORT})",
    )


def parser() -> argparse.ArgumentParser:
    main_parser = argparse.ArgumentParser(prog="cosyvoice-serve", description=__doc__.split("\n")[0])
    commands = main_parser.add_subparsers(dest="command", required=True)

    run_parser = commands.add_parser("run", help="start a local Ray and the app")
    run_parser.add_argument(
        "--model",
        "--model-dir",
        dest="model",
        default=None,
        help="an official model dir, a Hugging Face id (FunAudioLLM/Fun-CosyVoice3-0.5B-2512: downloaded into the "
        "Hugging Face cache, HF_HOME), modelscope:<id>, or a preset: tiny (the default), cosyvoice2-tiny, ...",
    )
    run_parser.add_argument(
        "--llm-checkpoint",
        default=None,
        help="the LLM checkpoint of an official model: auto (llm.rl.pt where the model has it, else llm.pt; the "
        "default) or a file name such as llm.pt",
    )
    run_parser.add_argument("--config", type=Path, default=None, help="Serve config file (its `args` are used)")
    add_device_option(run_parser)
    run_parser.add_argument(
        "--voices-dir",
        type=Path,
        default=None,
        help="where registered voices are kept (default: ~/.local/share/cosyvoice-serve/voices/<model> when the "
        "model has cloning models)",
    )
    run_parser.add_argument(
        "--voice-models-dir",
        type=Path,
        default=None,
        help="campplus.onnx and the speech tokenizer (speech_tokenizer_v1/v2/v3.onnx; default: the model dir)",
    )
    run_parser.add_argument("--host", default=None)
    run_parser.add_argument("--port", type=int, default=None)
    run_parser.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus metrics port (default: one Ray picks, printed)"
    )
    run_parser.add_argument(
        "--wyoming-port",
        type=int,
        default=None,
        help="also serve the Wyoming protocol (Home Assistant) on this TCP port, e.g. 10200 (default: off)",
    )
    run_parser.add_argument(
        "--wyoming-host",
        default=None,
        help="the address Wyoming binds (default: 127.0.0.1; 0.0.0.0 for a Home Assistant on another machine: Wyoming "
        "has no authentication)",
    )
    run_parser.add_argument(
        "--wyoming-allow-keyless",
        action="store_true",
        help="serve Wyoming on a server with API keys all the same: its clients send none, and use the shared voices",
    )
    run_parser.set_defaults(handler=run)

    plan_parser = commands.add_parser(
        "plan", help="what runs where on this machine (or one described by --gpus, --gpu-memory-gb), as run would"
    )
    plan_parser.add_argument("--model", default=None, help="as run's --model (default: the config's, else tiny)")
    plan_parser.add_argument("--llm-checkpoint", default=None)
    plan_parser.add_argument("--config", type=Path, default=None, help="Serve config file (its `args` are used)")
    add_device_option(plan_parser)
    plan_parser.add_argument("--gpus", type=int, default=None, help="plan for this many GPUs (0: none) instead")
    plan_parser.add_argument("--gpu-memory-gb", type=float, default=None, help="each such GPU's memory, GiB")
    plan_parser.add_argument(
        "--gpu-name", default="GPU", help="their name (nvidia-smi's), for the printout and a footprint recorded for it"
    )
    plan_parser.add_argument(
        "--no-native-bfloat16", action="store_true", help="they predate Ampere (no native bfloat16: CosyVoice3 float16)"
    )
    plan_parser.add_argument("--cpus", type=float, default=None, help="CPUs Ray has (default: this machine's)")
    plan_parser.add_argument("--json", action="store_true", help="the plan as JSON")
    plan_parser.set_defaults(handler=show_plan)

    download_parser = commands.add_parser(
        "download", help="download a hub model into its cache (HF_HOME; what run does first) and print its directory"
    )
    download_parser.add_argument("model", help="a Hugging Face id, or modelscope:<id>")
    download_parser.set_defaults(handler=download)

    normalize_parser = commands.add_parser(
        "normalize", help="print what the model reads of a text: its segments after normalisation (no server needed)"
    )
    normalize_parser.add_argument("text")
    normalize_parser.add_argument("--model", default=None, help="as run's --model (default: the config's, else tiny)")
    normalize_parser.add_argument(
        "--language", default=None, help="the text's language: de, ja, ... (default: each sentence's, detected)"
    )
    normalize_parser.add_argument(
        "--config", type=Path, default=None, help="Serve config file (its `args` are used: model, text, limits)"
    )
    normalize_parser.set_defaults(handler=normalize)

    say_parser = commands.add_parser("say", help="synthesise text through a running server")
    say_parser.add_argument("text")
    say_parser.add_argument("-o", "--output", default="out.wav")
    add_url_option(say_parser)
    say_parser.add_argument("--voice", default=None, help="default: the model's first voice")
    say_parser.add_argument("--format", default="wav")
    say_parser.add_argument("--stream", action="store_true", help="write audio as it arrives (every format but flac)")
    say_parser.add_argument("--instruct-text", dest="instruct_text", default=None)
    say_parser.add_argument("--seed", type=int, default=None)
    say_parser.add_argument("--speed", type=float, default=None)
    say_parser.add_argument("--timeout", type=float, default=300.0)
    add_api_key_option(say_parser)
    say_parser.set_defaults(handler=say)

    bench_parser = commands.add_parser("bench", help="HTTP load benchmark: concurrency sweep, whole and streaming")
    bench_parser.add_argument(
        "--url",
        default=os.environ.get(URL_ENV),
        help=f"a running server (default: ${URL_ENV}, else start the local app)",
    )
    bench_parser.add_argument("--model", default="tiny", help="model of the local app when no --url")
    bench_parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    bench_parser.add_argument("--modes", nargs="+", choices=["whole", "stream"], default=["whole", "stream"])
    bench_parser.add_argument("--requests", type=int, default=16, help="requests per mode and concurrency")
    bench_parser.add_argument(
        "--max-token-text-ratio", type=float, default=3.0, help="speech-token cap for dummy weights; 0: model default"
    )
    bench_parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    add_repeat_options(bench_parser)
    bench_parser.add_argument("--out", type=Path, default=Path("out/bench"))
    add_api_key_option(bench_parser)
    bench_parser.set_defaults(handler=bench)

    voices_parser = commands.add_parser("voices", help="register, list and delete the voices of a running server")
    actions = voices_parser.add_subparsers(dest="action", required=True)
    add_parser = actions.add_parser("add", help="clone a voice from a 1-30 s recording and its transcript")
    add_parser.add_argument("file", type=Path, help="wav, flac, ogg or mp3")
    add_parser.add_argument("--transcript", required=True, help="what the recording says")
    add_parser.add_argument("--name", default=None, help="a display name")
    add_parser.add_argument("--shared", action="store_true", help="usable by every API key (admin keys only)")
    add_parser.add_argument(
        "--openai-name", default=None, help="a name OpenAI clients may send as `voice` for it (e.g. narrator)"
    )
    actions.add_parser("list", help="the built-in speakers and the registered voices")
    rm_parser = actions.add_parser("rm", help="delete a registered voice")
    rm_parser.add_argument("voice_id")
    for action in actions.choices.values():
        add_url_option(action)
        action.add_argument("--timeout", type=float, default=120.0)
        add_api_key_option(action)
    voices_parser.set_defaults(handler=voices)
    return main_parser


def main(argv: list[str] | None = None) -> int:
    options = parser().parse_args(argv)
    return options.handler(options)


if __name__ == "__main__":
    sys.exit(main())
