"""Serve-side pieces that need no Ray cluster: device choice, error mapping, typed app arguments."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from ray.exceptions import RayTaskError

from deployments.decoder import resolve_device_and_dtype
from engine.errors import InvalidInputError, NonFiniteOutputError, UnknownVoiceError
from serve_app.app import error_payload
from serve_app.args import AppArgs, DecoderArgs


def test_cpu_replica_runs_fp32_unless_told_otherwise() -> None:
    assert resolve_device_and_dtype(use_gpu=False, dtype="auto") == ("cpu", "float32")
    assert resolve_device_and_dtype(use_gpu=False, dtype="bfloat16") == ("cpu", "bfloat16")


@pytest.mark.parametrize(
    ("error", "status"),
    [(InvalidInputError("bad speed"), 400), (UnknownVoiceError("no voice"), 404), (NonFiniteOutputError("nan"), 500)],
)
def test_engine_errors_map_to_openai_error_bodies(error: Exception, status: int) -> None:
    for raised in (error, RayTaskError("encode", "traceback", error)):  # as it arrives from another replica
        got_status, body = error_payload(raised)
        assert got_status == status
        assert body["error"]["message"] == error.message
        assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")
        assert body["error"]["code"] == type(error).__name__


def test_unexpected_errors_are_500_with_a_message() -> None:
    status, body = error_payload(RuntimeError("boom"))
    assert status == 500 and "boom" in body["error"]["message"]


def test_app_args_defaults_and_validation() -> None:
    args = AppArgs.model_validate({"model": "tiny", "decoder": {"max_batch_size": 8}})
    assert args.decoder.num_gpus == 0 and args.decoder.ongoing_requests_limit >= 8
    with pytest.raises(ValidationError, match="max_ongoing_requests"):
        DecoderArgs(max_batch_size=8, max_ongoing_requests=4)
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"decoder": {"num_gpus": 1.5}})
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"modle": "tiny"})
