"""The FastAPI app the ingress serves: the try-it page's files, the error handlers and the middlewares (request ids and
metrics, API keys and body limits, per-key tenancy). Each route module of serve_app adds its routes to `api`."""

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException

from engine.errors import CosyVoiceError
from observability.http import RequestObservability
from serve_app.errors import error_body, error_response, validation_message, validation_param
from serve_app.guard import RequestGuard
from serve_app.tenancy import KeyTenancy

api = FastAPI(title="cosyvoice-serve", description="CosyVoice text-to-speech on Ray Serve")
# The try-it page (GET /) and its script and style: plain files, no build step.
STATIC_DIR = Path(__file__).parent / "static"
api.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


@api.exception_handler(RequestValidationError)
async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    body = error_body(400, validation_message(exc), "invalid_request", validation_param(exc))
    return JSONResponse(body, status_code=400)


@api.exception_handler(HTTPException)
async def _on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(exc.status_code, str(exc.detail), "http_error"), status_code=exc.status_code)


# CosyVoiceError and a lost replica are handled inside the middleware below, which thus counts the status the client
# gets (503 for a lost replica); what only the `Exception` handler takes is answered outside it, as 500.
@api.exception_handler(CosyVoiceError)
@api.exception_handler(RayActorError)
@api.exception_handler(Exception)
async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc, request.scope.get("state", {}).get("request_id", "unknown"))


def _reject_request_id(message: str) -> JSONResponse:
    return JSONResponse(error_body(400, message, "invalid_request_id"), status_code=400)


# Each key's identity and in-flight limit, inside the guard: with keys on, only valid keys reach it.
api.add_middleware(KeyTenancy, error_body=error_body)
# API keys and the body size limit; added before the next, so it runs inside the observability middleware (401s are
# counted).
api.add_middleware(RequestGuard, error_body=error_body)
api.add_middleware(RequestObservability, reject=_reject_request_id)
