"""The tool definitions the tests share: a weather and a time tool in the chat-completions shape
(``{"type": "function", "function": {...}}``), with the bounds each test needs so a
random-weight model finishes its calls, and the same tools in the Responses API's flat shape.

Every parameter a tool has is required; ``closed`` adds ``"additionalProperties": false``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CELSIUS_FAHRENHEIT = ("celsius", "fahrenheit")


def function_tool(
    name: str,
    properties: Mapping[str, Any],
    description: str | None = None,
    closed: bool = True,
) -> dict[str, Any]:
    """A chat-completions tool whose parameters are ``properties``, all required."""
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": dict(properties),
        "required": list(properties),
    }
    if closed:
        parameters["additionalProperties"] = False
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def weather_tool(
    city_max_length: int | None,
    units: Sequence[str] | None = CELSIUS_FAHRENHEIT,
    description: str | None = None,
    closed: bool = True,
) -> dict[str, Any]:
    """``get_weather(city, unit)``: a city name of at most ``city_max_length`` characters
    (None: no city) and a unit among ``units`` (None: no unit)."""
    properties: dict[str, Any] = {}
    if city_max_length is not None:
        properties["city"] = {"type": "string", "maxLength": city_max_length}
    if units is not None:
        properties["unit"] = {"enum": list(units)}
    return function_tool("get_weather", properties, description, closed)


def time_tool(zone: Mapping[str, Any], closed: bool = True) -> dict[str, Any]:
    """``get_time(zone)``, the zone's schema as given."""
    return function_tool("get_time", {"zone": dict(zone)}, closed=closed)


def responses_tool(tool: Mapping[str, Any], strict: bool | None = None) -> dict[str, Any]:
    """``tool`` in the Responses API's shape: the function's members beside ``"type"``."""
    flat = {"type": "function", **tool["function"]}
    return flat if strict is None else flat | {"strict": strict}


def parameters_by_name(tools: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's parameters schema by its name (either shape)."""
    functions = (tool.get("function", tool) for tool in tools)
    return {function["name"]: function["parameters"] for function in functions}
