"""Typed errors raised at the engine's boundary; each dialect maps them to its own JSON."""


class ShoalError(Exception):
    """Base class. `status_code` is the HTTP status a dialect should answer with."""

    status_code: int = 500
    error_type: str = "internal_error"
    code: str | None = None
    retry_after_s: float | None = None  # sent as Retry-After when set

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(ShoalError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """The prompt plus the requested output can never fit in the model's context."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        requested = num_prompt_tokens + max_tokens
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens, but "
            f"{requested} tokens were requested ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion).",
            param="max_tokens" if num_prompt_tokens < max_model_len else "prompt",
        )


class ModelLoadError(ShoalError):
    """A model could not be loaded: unknown architecture, missing file, corrupt weights."""

    status_code = 500
    error_type = "model_load_error"

    def __init__(self, model: str, problem: str) -> None:
        super().__init__(f"cannot load model {model!r}: {problem}")
        self.model = model
        self.problem = problem

    def __reduce__(self):  # noqa: ANN204 (pickled across processes with both fields)
        return (ModelLoadError, (self.model, self.problem))


class OverloadedError(ShoalError):
    """Every replica of the model is busy and the waiting line is full: retry later."""

    status_code = 503
    error_type = "service_unavailable"
    code = "overloaded"

    def __init__(self, message: str, status_code: int = 503, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retry_after_s = retry_after_s


class UnavailableError(ShoalError):
    """What a request needs cannot be had on the server now (a LoRA adapter whose files
    cannot be read any more): not the client's fault, and the details are the server's."""

    status_code = 503
    error_type = "service_unavailable"


class NotFoundError(ShoalError):
    status_code = 404
    error_type = "not_found_error"


class NotImplementedByServerError(ShoalError):
    status_code = 501
    error_type = "not_implemented_error"


class PermissionDeniedError(ShoalError):
    status_code = 403
    error_type = "permission_error"


class ConflictError(ShoalError):
    status_code = 409
    error_type = "conflict_error"


class RemoteError(ShoalError):
    """A ShoalError raised in another process, rebuilt with its status and type."""

    def __init__(self, status_code: int, error_type: str, message: str, param: str | None):
        super().__init__(message, param)
        self.status_code = status_code
        self.error_type = error_type

    def __reduce__(self):  # noqa: ANN204 (pickled across processes with all four fields)
        return (RemoteError, (self.status_code, self.error_type, self.message, self.param))


class ContextGoneError(NotFoundError):
    """A context the server dropped to stay within its limits (reported once)."""

    status_code = 410
    error_type = "context_gone_error"


class CapacityError(ShoalError):
    """A per-replica limit is reached and nothing can be reclaimed now: retry later."""

    status_code = 429
    error_type = "rate_limit_error"
    retry_after_s = 1.0
