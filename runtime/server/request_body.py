"""Reading a JSON request body: size limit (413), malformed JSON (400), schema errors (400
naming the field). Bodies are parsed here rather than by FastAPI so every such failure gets
the status and error shape the API promises."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from runtime.server.errors import ApiError

Model = TypeVar("Model", bound=BaseModel)


async def read_json(request: Request, max_bytes: int) -> Any:
    """The body parsed as JSON. Raises ApiError 413 when it is (or declares to be) longer than
    ``max_bytes``, 400 when it is not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def parse_model(model: type[Model], data: Any) -> Model:
    """Validate ``data`` against a request model; ApiError 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _field_path(first["loc"], data, keep_last=first["type"] in _ABSENT_FIELD) or None
        if first["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        else:
            message = f"{param}: {first['msg']}" if param else first["msg"]
        raise ApiError(400, message, param=param) from None


# Errors about a field that is not in the input (so its name is not found by walking it).
_ABSENT_FIELD = ("missing", "extra_forbidden")


def _field_path(loc: tuple[int | str, ...], data: Any, keep_last: bool) -> str:
    """The dotted path of ``loc`` through the input (``messages.0.role``). pydantic also puts
    the member type of a union in ``loc`` (``text.list[str]``); those parts are not in the
    input and are left out."""
    parts: list[str] = []
    for i, part in enumerate(loc):
        found = (isinstance(data, dict) and part in data) or (
            isinstance(data, list) and isinstance(part, int) and part < len(data)
        )
        if found:
            parts.append(str(part))
            data = data[part]
        elif keep_last and i == len(loc) - 1:
            parts.append(str(part))
    return ".".join(parts)
