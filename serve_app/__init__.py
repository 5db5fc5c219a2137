"""The Ray Serve application: `serve run serve_app:build_app model=...` (typed args: `serve_app.args.AppArgs`),
or the default tiny-model app `serve_app:app`."""

from typing import Any

__all__ = ["app", "build_app"]


def __getattr__(name: str) -> Any:
    # Built on first use: the CLI (`cosyvoice-serve say`) imports this package and must not wait for torch and Ray.
    if name in __all__:
        from serve_app import ingress

        return getattr(ingress, name)
    raise AttributeError(f"module 'serve_app' has no attribute {name!r}")
