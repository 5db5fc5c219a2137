"""Starting the real application for a test module: one small local Ray, Serve on a free 127.0.0.1 port."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray import serve

from benchmarks.http_bench import free_port
from serve_app import build_app

OBJECT_STORE_BYTES = 256 * 2**20  # the default (30% of RAM) is far more than the tiny model needs


@contextmanager
def running_app(app_args: dict[str, Any], app_name: str, **ray_options: Any) -> Iterator[str]:
    """`build_app(app_args)` served at route "/" on a 2-CPU Ray; yields the base URL, shuts both down after."""
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
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args), name=app_name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
