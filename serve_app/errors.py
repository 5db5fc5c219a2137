"""The ingress's errors: the types it raises, OpenAI's error shape, and the HTTP status each exception gets."""

import logging
import math
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from engine.errors import CosyVoiceError, UnavailableError

logger = logging.getLogger("ray.serve")


class UnknownModelError(CosyVoiceError):
    http_status = 404


# The Retry-After of 503 (overload: Serve's backpressure, a text stream cap; a replica lost) and 429 answers: whole
# seconds, and 1, the fewest, since a slot frees as soon as any request ends.
RETRY_AFTER_S = 1.0


class ServiceUnavailableError(UnavailableError):
    """A full queue (backpressure) or a lost replica: answered 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = RETRY_AFTER_S if retry_after_s is None else retry_after_s


class StreamIdleError(CosyVoiceError):
    """A text stream that sent nothing for `TEXT_STREAM_IDLE_S` while no audio was in the making."""

    http_status = 408


class UploadTooLargeError(CosyVoiceError):
    """A voice upload over `engine.voices.cloning.MAX_PROMPT_AUDIO_BYTES`."""

    http_status = 413


# Raised by deployment handles; Serve answers the first two itself in plain text unless they are translated.
SERVE_UNAVAILABLE = (BackPressureError, DeploymentUnavailableError)
# A replica lost (its process, or its whole node): the call fails with RayActorError, or, with a node, a result the
# replica had already made but that lived in that node's object store cannot be fetched any more (ObjectLostError:
# ObjectReconstructionFailedError, OwnerDiedError, ...). The call is seeded: sent again, it gives the same result.
REPLICA_LOST = (RayActorError, ObjectLostError)


def unavailable_error(exc: BaseException) -> ServiceUnavailableError | None:
    """The 503 for Serve's overload and replica-failure errors, None for anything else. Its message is ours; Serve's
    own text (queue sizes, replica names) goes to the log only."""
    if isinstance(exc, BackPressureError):
        error = ServiceUnavailableError("the server is at capacity; retry later", exc.retry_after_s)
    elif isinstance(exc, DeploymentUnavailableError):
        error = ServiceUnavailableError("no replica can take the request; retry later")
    elif isinstance(exc, REPLICA_LOST):
        error = ServiceUnavailableError("a replica failed while serving this request; retry")
    else:
        return None
    logger.warning("%s: %s", error.message, exc)
    return error


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; `param` names the request field at fault, where one is."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def engine_error(exc: BaseException) -> CosyVoiceError | None:
    """The engine error behind `exc`, looking through Ray's wrapping of errors raised in other replicas."""
    while isinstance(exc, RayTaskError):
        exc = exc.cause
    return exc if isinstance(exc, CosyVoiceError) else unavailable_error(exc)


def error_payload(exc: BaseException, request_id: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI-shaped body) for an exception. A 500 says only "internal error" and the request id,
    never what failed inside: that goes to the log line, with the same id and the traceback."""
    error = engine_error(exc)
    status = 500 if error is None else error.http_status
    code = "internal_error" if error is None else type(error).__name__  # a class name tells no internals
    if status == 500:
        logger.error("internal error", exc_info=exc, extra={"request_id": request_id})
        return 500, error_body(500, f"internal error (request id {request_id})", code)
    assert error is not None
    message = error.message if status < 500 else f"{error.message} (request id {request_id})"
    return status, error_body(status, message, code)


def error_response(exc: BaseException, request_id: str) -> JSONResponse:
    status, body = error_payload(exc, request_id)
    error = engine_error(exc)
    headers = None
    if isinstance(error, UnavailableError):  # the engine's (a failed decoder loop) has no retry_after_s of its own
        retry_after_s = getattr(error, "retry_after_s", RETRY_AFTER_S)
        headers = {"Retry-After": str(max(0, math.ceil(retry_after_s)))}
    return JSONResponse(body, status_code=status, headers=headers)


def _field_of(item: dict[str, Any]) -> str:
    return ".".join(str(p) for p in item.get("loc", ()) if p != "body")


def validation_param(exc: RequestValidationError) -> str | None:
    """The field of the first validation error (OpenAI's `param`); None for a body that is not JSON."""
    errors = exc.errors()
    if not errors or errors[0]["type"] == "json_invalid":
        return None
    return _field_of(errors[0]) or None


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for item in exc.errors():
        if item["type"] == "json_invalid":
            return f"malformed JSON body: {item.get('ctx', {}).get('error', item['msg'])}"
        where = _field_of(item)
        parts.append(f"{where}: {item['msg']}" if where else item["msg"])
    return "invalid request: " + "; ".join(parts)
