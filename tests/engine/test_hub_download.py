"""A real download of a hub model: `cosyvoice-serve download <id>` (the step every cluster node runs, and `run` first)
through huggingface_hub against a local stand-in for the Hugging Face Hub (HF_ENDPOINT), never the internet.

The stand-in answers the routes snapshot_download calls, as huggingface_hub 2.4 calls them: the revision's commit
(`/api/models/{id}/revision/{rev}`), its file list (`/api/models/{id}/tree/{commit}`), each file's metadata (HEAD
`/{id}/resolve/{commit}/{file}`: X-Repo-Commit, ETag, Content-Length) and its bytes (GET, with a Range). Its repo is
the v3 kit's tiny model and one file larger than huggingface_hub's read size (DOWNLOAD_CHUNK_SIZE, 10 MiB), whose
first GET is cut after one read: huggingface_hub keeps the whole reads it wrote and asks for the rest with a Range, in
the same call (a file cut before one whole read, like every file of the kit, starts over; and a cut across processes
is not resumed by 2.4: each process downloads into a file of its own, deleted when it fails)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

from engine.loading.model_source import UNUSED_FILES
from tests.engine.conftest import REPO_ID, V3_KIT_MODEL

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
LARGE_FILE = "large_file.bin"  # no file the engine reads: only its size matters here
CUT_AT = DOWNLOAD_CHUNK_SIZE * 5 // 4  # one whole read and a part of the next
Requests = list[tuple[str, str, str | None]]


class StandInHub(BaseHTTPRequestHandler):
    """The Hub's routes for one model repo at one commit; every request is logged as (method, path, Range)."""

    repo: dict[str, bytes]  # its files
    requests: Requests
    cut_once: set[str]  # the files whose first GET is cut at CUT_AT

    def log_message(self, *args: object) -> None:  # the test reads self.requests instead
        pass

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        self.requests.append((self.command, path, self.headers.get("Range")))
        file = path.removeprefix(f"/{REPO_ID}/resolve/{COMMIT}/")
        if path.startswith(f"/api/models/{REPO_ID}/revision/"):
            self._json({"id": REPO_ID, "sha": COMMIT, "siblings": [{"rfilename": name} for name in self.repo]})
        elif path == f"/api/models/{REPO_ID}/tree/{COMMIT}":
            entries = [
                {"type": "file", "path": name, "size": len(data), "oid": name} for name, data in self.repo.items()
            ]
            self._json(entries)
        elif file in self.repo:
            self._file(file, send_body)
        else:  # as the Hub answers a route or an id it does not have
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.end_headers()

    def _json(self, value: object) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _file(self, name: str, send_body: bool) -> None:
        data = self.repo[name]
        start = int(re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "bytes=0-"))[1])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not send_body:
            return
        if name in self.cut_once:  # fewer bytes than promised, then the connection closes (HTTP/1.0)
            self.cut_once.discard(name)
            self.wfile.write(data[:CUT_AT])
            return
        self.wfile.write(data[start:])


@pytest.fixture
def repo() -> dict[str, bytes]:
    """The kit's model, and the large file."""
    files = {
        str(path.relative_to(V3_KIT_MODEL)): path.read_bytes() for path in V3_KIT_MODEL.rglob("*") if path.is_file()
    }
    return files | {LARGE_FILE: bytes(range(256)) * (DOWNLOAD_CHUNK_SIZE * 3 // 2 // 256)}


@pytest.fixture
def hub(repo: dict[str, bytes]) -> Iterator[tuple[str, Requests]]:
    """The stand-in hub's URL and its request log."""
    handler = type("Handler", (StandInHub,), {"repo": repo, "requests": [], "cut_once": {LARGE_FILE}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler.requests
    server.shutdown()
    thread.join()


def download_on_a_terminal(home: Path, endpoint: str, offline: bool = False) -> tuple[int, str, str]:
    """`cosyvoice-serve download REPO_ID` with its stderr on a pseudo-terminal, as in a user's shell (huggingface_hub
    draws its byte bars on a terminal only) -> (exit code, stdout, what the terminal showed)."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    environment |= {"HF_HOME": str(home), "HF_ENDPOINT": endpoint} | ({"HF_HUB_OFFLINE": "1"} if offline else {})
    terminal, child_end = pty.openpty()
    fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new one is 0 wide: no bars
    command = [sys.executable, "-m", "serve_app.cli", "download", REPO_ID]
    process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=child_end, text=True)
    os.close(child_end)
    shown = bytearray()
    deadline = time.monotonic() + 120
    while select.select([terminal], [], [], max(0.0, deadline - time.monotonic()))[0]:
        try:
            piece = os.read(terminal, 65536)
        except OSError:  # EIO: the child's end is closed
            break
        if not piece:
            break
        shown += piece
    os.close(terminal)
    stdout, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
    return process.returncode, stdout, shown.decode(errors="replace")


def test_a_download_through_huggingface_hub_resumes_a_cut_file_and_shows_its_progress(
    tmp_path: Path, repo: dict[str, bytes], hub: tuple[str, Requests]
) -> None:
    endpoint, requests = hub
    code, stdout, terminal = download_on_a_terminal(tmp_path, endpoint)
    assert code == 0, terminal
    snapshot = Path(stdout.strip())
    assert snapshot == tmp_path / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT

    fetched = {str(path.relative_to(snapshot)) for path in snapshot.rglob("*") if path.is_file()}
    excluded = {name for name in repo if any(Path(name).match(pattern) for pattern in UNUSED_FILES)}
    assert fetched == set(repo) - excluded and excluded  # the files the engine never reads stay on the hub
    for name in fetched:
        assert (snapshot / name).read_bytes() == repo[name], name

    gets = [byte_range for method, path, byte_range in requests if method == "GET" and path.endswith(LARGE_FILE)]
    assert gets == [None, f"bytes={DOWNLOAD_CHUNK_SIZE}-"]  # resumed after the whole read it kept
    assert "Trying to resume download" in terminal
    # huggingface_hub's progress bars: the files, and the bytes to the whole size of what was fetched
    assert re.search(rf"Fetching {len(fetched)} files: *100%", terminal)
    total = sum(len(repo[name]) for name in fetched)
    size = f"{total / 1e6:.1f}MB"  # the cut bytes counted once
    assert re.search(rf"Reconstruction complete: 100%\|[^|]*\| {size} / {size}", terminal), terminal

    # Offline, as a cluster's replicas read it (HF_HUB_OFFLINE), the same snapshot without asking the hub again
    asked = len(requests)
    code, stdout, terminal = download_on_a_terminal(tmp_path, endpoint, offline=True)
    assert code == 0 and Path(stdout.strip()) == snapshot and len(requests) == asked, terminal
