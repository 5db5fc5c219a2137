"""Serve-side pieces that need no Ray cluster: load window, error mapping, typed app arguments."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from ray.exceptions import RayTaskError

from deployments.decoder import resolve_device_and_dtype
from deployments.stats import LoadWindow
from engine.errors import InvalidInputError, NonFiniteOutputError, UnknownVoiceError
from serve_app.app import error_payload
from serve_app.args import AppArgs, DecoderArgs


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_busy_fraction_counts_overlapping_sections_once_and_slides() -> None:
    clock = FakeClock()
    window = LoadWindow(window_s=10.0, clock=clock)
    with window.busy():
        clock.now += 2.0
        with window.busy():  # a concurrent batch inside the first one
            clock.now += 1.0
        clock.now += 1.0
    assert window.busy_fraction() == pytest.approx(0.4)
    clock.now += 3.0
    with window.busy():
        clock.now += 1.0
        assert window.busy_fraction() == pytest.approx(0.5)  # the running section counts too
    clock.now += 20.0
    assert window.busy_fraction() == 0.0


def test_mean_batch_size_over_window_and_counts_since_start() -> None:
    clock = FakeClock()
    window = LoadWindow(window_s=10.0, clock=clock)
    window.record_batch(1)
    clock.now += 8.0
    window.record_batch(3)
    window.record_batch(4)
    assert window.mean_batch_size() == pytest.approx(8 / 3)
    clock.now += 5.0  # the first batch left the window
    assert window.mean_batch_size() == pytest.approx(3.5)
    assert dict(window.batch_size_counts) == {1: 1, 3: 1, 4: 1}


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
