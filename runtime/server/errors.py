"""Errors at the HTTP edge and the JSON shapes of error responses.

Every route but the Messages API answers OpenAI's shape,
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``: the ``openai`` client
reads it, and native clients get the same shape so there is one thing to parse. The Messages
API's routes (``/v1/messages...``) answer Anthropic's,
``{"type": "error", "error": {"type": ..., "message": ...}}``, which the ``anthropic`` client
reads; the message names the field.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """A request the server refuses; ``status_code`` is the HTTP status, ``param`` the field."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code


class ClientGone(Exception):
    """The client closed the connection; its requests have been aborted."""


def error_type(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code == 404:
        return "not_found_error"
    if status_code < 500:
        return "invalid_request_error"
    return "server_error"


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type(status_code),
            "param": param,
            "code": code,
        }
    }


MESSAGES_API_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status_code: int, message: str) -> dict[str, Any]:
    fallback = "invalid_request_error" if status_code < 500 else "api_error"
    kind = _ANTHROPIC_TYPES.get(status_code, fallback)
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_messages_api(path: str) -> bool:
    return path == MESSAGES_API_PATH or path.startswith(MESSAGES_API_PATH + "/")


def error_body_for(
    path: str, status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The error body in the shape of the API that serves ``path``."""
    if is_messages_api(path):
        return anthropic_error_body(status_code, message)
    return error_body(status_code, message, param, code)


def error_response(error: ApiError, path: str = "") -> JSONResponse:
    """``error`` as the response of a request to ``path``."""
    return JSONResponse(
        error_body_for(path, error.status_code, error.message, error.param, error.code),
        status_code=error.status_code,
    )
