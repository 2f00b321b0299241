"""The one place where errors become responses. Routes raise (a ShoalError, a validation
error); they never build error JSON themselves. An error's shape is OpenAI's
(`openai_body`) unless a dialect registered its own for the paths it owns
(`error_shape`, e.g. Ollama's {"error": "..."} under /api/); the request guard's errors
(401, 408, 413) take the same shapes."""

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.protocol.errors import ShoalError

logger = logging.getLogger("ray.serve")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def openai_body(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    error_type: str | None = None,
) -> dict:
    return {
        "error": {
            "message": message,
            "type": error_type or _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_body(exc: ShoalError) -> dict:
    """OpenAI's error object for a ShoalError (also a stream's error event)."""
    return openai_body(exc.status_code, exc.message, exc.param, exc.code, exc.error_type)


def relative_path(scope: dict) -> str:
    """The path below the application's route prefix."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


# (path prefix, body builder) of dialects whose errors are not in OpenAI's shape.
ErrorShape = Callable[[int, str, str | None, str | None, str | None], dict]
_SHAPES: list[tuple[str, ErrorShape]] = []


def error_shape(prefix: str) -> Callable[[ErrorShape], ErrorShape]:
    """Register a dialect's error body for the paths under `prefix` (a route module does
    this for its own routes)."""

    def register(shape: ErrorShape) -> ErrorShape:
        _SHAPES.append((prefix, shape))
        return shape

    return register


def dialect_body(
    path: str,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    error_type: str | None = None,
) -> dict:
    """An error in the shape of the dialect that owns `path`."""
    shape = next((s for prefix, s in _SHAPES if path.startswith(prefix)), openai_body)
    return shape(status, message, param, code, error_type)


def error_response(
    request: Request,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    error_type: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = dialect_body(relative_path(request.scope), status, message, param, code, error_type)
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ShoalError)
    async def _shoal(request: Request, exc: ShoalError) -> JSONResponse:
        headers = None
        if exc.retry_after_s is not None:
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
        return error_response(
            request, exc.status_code, exc.message, exc.param, exc.code, exc.error_type, headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc)
        if err.get("type") == "extra_forbidden":  # OpenAI's words for an unknown field
            message = f"Unrecognized request argument supplied: {where}"
        else:
            message = f"{where}: {err.get('msg')}" if where else str(err.get("msg"))
        return error_response(request, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request, exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s", request.url.path)
        return error_response(request, 500, "internal server error", error_type="server_error")
