"""Errors at the HTTP edge and the one JSON shape every error response has (OpenAI's).

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``: the ``openai`` client
reads it, and native clients get the same shape so there is one thing to parse.
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


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(
        error_body(error.status_code, error.message, error.param, error.code),
        status_code=error.status_code,
    )
