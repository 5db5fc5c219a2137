"""Console entry point `cosyvoice-serve`.

cosyvoice-serve run [--model DIR|ID|PRESET] [--config FILE]   start a local Ray and the app (tiny model by default)
                    [--wyoming-port 10200]                also the Wyoming protocol, for Home Assistant
cosyvoice-serve plan [--model M] [--gpus N --gpu-memory-gb G] [--json]   what runs where on this machine
cosyvoice-serve download ID                            download a hub model into its cache
cosyvoice-serve say "text" -o out.wav                  synthesise through a running server
cosyvoice-serve bench [--url URL] [--out DIR]           HTTP load benchmark (see serve_app/bench/http_load.py)
cosyvoice-serve voices add FILE --transcript TEXT | list | rm ID   registered voices of a running server
cosyvoice-serve normalize TEXT [--model M] [--language L]   what the model reads of TEXT (no server)

The parser and the dispatch; each command's work is in `cli_run` (run), `cli_offline` (plan, download, normalize) or
`cli_client` (say, voices, bench).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from serve_app.bench.timing import add_repeat_options
from serve_app.cli_client import API_KEY_ENV, bench, default_server_url, say, voices
from serve_app.cli_offline import download, normalize, show_plan
from serve_app.cli_run import DEFAULT_HOST, DEFAULT_PORT, URL_ENV, run


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
