"""Metrics, request ids and logging settings shared by the deployments (see docs/observability.md)."""

STRUCTURED_LOGGING = {"encoding": "JSON"}
"""Serve `logging_config` of every deployment: one JSON object per line, with request_id and extras."""
