"""The commands that talk to a running server over HTTP: `cosyvoice-serve say` (synthesise a text into a file),
`voices` (register, list, delete voices) and `bench` (the HTTP load benchmark, `serve_app/bench/http_load.py`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

import httpx

from serve_app.bench.http_load import auth_headers
from serve_app.cli_run import DEFAULT_HOST, DEFAULT_PORT, URL_ENV

API_KEY_ENV = "COSYVOICE_API_KEY"  # the key `say` and `bench` send to a server with API keys


def default_server_url(environ: Mapping[str, str] = os.environ) -> str:
    """The client commands' server: $COSYVOICE_URL, else the address `run` serves on by default."""
    return environ.get(URL_ENV) or f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"


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
