"""Reading a JSON request body: size limit (413), malformed JSON (400), schema errors (400
naming the field). Bodies are parsed here rather than by FastAPI so every such failure gets
the status and error shape the API promises."""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from runtime.request_checks import (
    MAX_JSON_DEPTH,
    InvalidRequestValue,
    check_json_value,
    json_nesting_depth,
    main_error,
)
from runtime.server.errors import ApiError

Model = TypeVar("Model", bound=BaseModel)


async def read_json(request: Request, max_bytes: int, timeout: float | None = None) -> Any:
    """The body parsed as JSON. Raises ApiError 413 when it is (or declares to be) longer than
    ``max_bytes``, 408 when it takes longer than ``timeout`` seconds to arrive, 400 when it is
    not JSON, nests deeper than MAX_JSON_DEPTH (checked before parsing) or holds a string with
    a lone surrogate (naming the field)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes")
    try:
        raw = await asyncio.wait_for(_read_body(request, max_bytes), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s") from None
    depth = json_nesting_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(
            400, f"the request body nests {depth} levels deep; the limit is {MAX_JSON_DEPTH}"
        )
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    try:
        check_json_value(data)
    except InvalidRequestValue as exc:
        raise ApiError(400, str(exc), param=exc.field or None) from None
    return data


async def _read_body(request: Request, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_model(model: type[Model], data: Any) -> Model:
    """Validate ``data`` against a request model; ApiError 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        loc, reason, kind = main_error(exc.errors())
        path = _field_path(loc, data, keep_last=kind in _ABSENT_FIELD)
        param, item = _split_item(path)
        if kind == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {path}"
        else:
            message = f"{param}: {item}{reason}" if param else reason
        raise ApiError(400, message, param=param or None) from None


def _split_item(path: str) -> tuple[str, str]:
    """("stop", "item 3: ") for "stop.3": ``param`` names the field, the message the item."""
    field, _, last = path.rpartition(".")
    if field and last.isdigit():
        return field, f"item {last}: "
    return path, ""


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
