"""The Ray Serve application: `serve run serve_app:build_app model=...` (typed args: `serve_app.args.AppArgs`),
or the default tiny-model app `serve_app:app`."""

from serve_app.app import app, build_app

__all__ = ["app", "build_app"]
