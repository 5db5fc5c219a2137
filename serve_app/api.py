"""The FastAPI app an ingress replica serves (`build_api`): its route groups' routes, the try-it page's files, the error
handlers and the middlewares (request ids and metrics, API keys and body limits, per-key tenancy) with the replica's
settings."""

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException

from engine.errors import CosyVoiceError
from observability.http import RequestObservability
from serve_app.errors import error_body, error_response, validation_message, validation_param
from serve_app.guard import GuardSettings, RequestGuard
from serve_app.tenancy import KeyTenancy, TenancySettings

# The try-it page (GET /) and its script and style: plain files, no build step.
STATIC_DIR = Path(__file__).parent / "static"


async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    body = error_body(400, validation_message(exc), "invalid_request", validation_param(exc))
    return JSONResponse(body, status_code=400)


async def _on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(exc.status_code, str(exc.detail), "http_error"), status_code=exc.status_code)


async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc, request.scope.get("state", {}).get("request_id", "unknown"))


# CosyVoiceError and a lost replica are handled inside the observability middleware, which thus counts the status the
# client gets (503 for a lost replica); what only the `Exception` handler takes is answered outside it, as 500.
EXCEPTION_HANDLERS = {
    RequestValidationError: _on_validation_error,
    HTTPException: _on_http_error,
    CosyVoiceError: _on_error,
    RayActorError: _on_error,
    Exception: _on_error,
}


def _reject_request_id(message: str) -> JSONResponse:
    return JSONResponse(error_body(400, message, "invalid_request_id"), status_code=400)


class RouteGroup(Protocol):
    """Routes on the ingress replica's `Synthesis` (serve_app's `*_routes` modules)."""

    def router(self) -> APIRouter: ...


def build_api(groups: Iterable[RouteGroup], guard: GuardSettings, tenancy: TenancySettings) -> FastAPI:
    """The app of the route groups behind the middlewares, with these settings of the guard and the tenancy."""
    api = FastAPI(
        title="cosyvoice-serve",
        description="CosyVoice text-to-speech on Ray Serve",
        exception_handlers=EXCEPTION_HANDLERS,
    )
    api.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    for group in groups:
        api.include_router(group.router())
    # Each key's identity and in-flight limit, inside the guard: with keys on, only valid keys reach it.
    api.add_middleware(KeyTenancy, error_body=error_body, settings=tenancy)
    # API keys and the body size limit; added before the next, so it runs inside the observability middleware (401s
    # are counted).
    api.add_middleware(RequestGuard, error_body=error_body, settings=guard)
    api.add_middleware(RequestObservability, reject=_reject_request_id)
    return api
