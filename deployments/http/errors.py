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

from app.protocol.errors import InvalidRequestError, RemoteError, ShoalError

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


def error_body(exc: ShoalError) -> dict:
    """OpenAI's error object for a ShoalError (also a stream's error event)."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.error_type or _TYPES.get(exc.status_code, "server_error"),
            "param": exc.param,
            "code": exc.code,
        }
    }


def relative_path(scope: dict) -> str:
    """The path below the application's route prefix."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


# (path prefix, body builder) of dialects whose errors are not in OpenAI's shape.
ErrorShape = Callable[[ShoalError], dict]
_SHAPES: list[tuple[str, ErrorShape]] = []


def error_shape(prefix: str) -> Callable[[ErrorShape], ErrorShape]:
    """Register a dialect's error body for the paths under `prefix` (a route module does
    this for its own routes)."""

    def register(shape: ErrorShape) -> ErrorShape:
        _SHAPES.append((prefix, shape))
        return shape

    return register


def dialect_body(path: str, exc: ShoalError) -> dict:
    """`exc` in the shape of the dialect that owns `path`."""
    shape = next((s for prefix, s in _SHAPES if path.startswith(prefix)), error_body)
    return shape(exc)


def error_response(request: Request, exc: ShoalError) -> JSONResponse:
    """`exc` in the shape of the dialect that owns the request's path."""
    body = dialect_body(relative_path(request.scope), exc)
    headers = None
    if exc.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Whatever a route raises becomes a ShoalError, answered by `error_response`."""

    @app.exception_handler(ShoalError)
    async def _shoal(request: Request, exc: ShoalError) -> JSONResponse:
        return error_response(request, exc)

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
        return error_response(request, InvalidRequestError(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request, RemoteError(exc.status_code, "", str(exc.detail), None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s", request.url.path)
        failure = RemoteError(500, "server_error", "internal server error", None)
        return error_response(request, failure)
