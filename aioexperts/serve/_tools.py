"""The request fields of tool calling and reasoning: ``tools``, ``tool_choice``, a message's
``tool_calls`` / ``tool_call_id``, and ``chat_template_kwargs`` (400 with the field named).

``tools`` are OpenAI's function tools (``{"type": "function", "function": {"name", "description",
"parameters"}}``); ``tool_choice`` is ``"auto"`` (the default with tools), ``"none"``, ``"required"``
or ``{"type": "function", "function": {"name": ...}}`` naming one of them. An assistant message's
``tool_calls`` reach the chat template as transformers passes them, with each call's ``arguments``
text read into an object when it is a JSON object (the templates of Qwen, Llama, Mistral and
DeepSeek print it with ``tojson``; llama.cpp does the same).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from aioexperts import ChatTemplate

from ._errors import APIError

__all__ = (
    "MAX_TOOLS",
    "parse_template_kwargs",
    "parse_tool_call_id",
    "parse_tool_calls",
    "parse_tool_choice",
    "parse_tools",
)

MAX_TOOLS = 128
"""Tools one request may give (OpenAI's limit)."""

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI: a-z, A-Z, 0-9, _ and -, at most 64 (. and : for MCP names)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"'{param}': {message}", param=param, code="invalid_value")


def _name(value: object, param: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise _bad(param, "must be a function name of 1 to 64 letters, digits, '_', '-', '.' or ':'")
    return value


def parse_tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """The ``tools`` of a chat request, each ``{"type": "function", "function": {...}}``."""
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise _bad("tools", "must be an array of tools")
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    out = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _bad(where, 'must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
        fn = tool["function"]
        name = _name(fn.get("name"), f"{where}.function.name")
        if name in seen:
            raise _bad(f"{where}.function.name", f"{name!r} is given twice")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"{where}.function.description", "must be a string")
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _bad(f"{where}.function.parameters", "must be a JSON Schema object")
        function: dict[str, Any] = {"name": name}
        if description is not None:
            function["description"] = description
        function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": function})
    return tuple(out)


def parse_tool_choice(body: Mapping[str, Any], tools: tuple[dict[str, Any], ...]) -> str:
    """``tool_choice`` as ``"auto"``, ``"none"``, ``"required"`` or ``"function:NAME"`` (a tool of ``tools``)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice != "none" and not tools:
            raise _bad("tool_choice", f"{choice!r} needs 'tools'")
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = _name(choice["function"].get("name"), "tool_choice.function.name")
        if name not in {t["function"]["name"] for t in tools}:
            raise _bad("tool_choice", f"names the function {name!r}, which is not in 'tools'")
        return "function:" + name
    raise _bad("tool_choice", 'must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}')


def _finite_float(text: str) -> float:
    """A JSON number's float, refused (``ValueError``) beyond the float range (``1e400`` would be
    ``inf``, which no JSON writer of the server may write back)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is beyond the float range")
    return value


def no_json_constant(name: str) -> Any:
    """``json.loads``'s ``parse_constant``: ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON
    (``ValueError``)."""
    raise ValueError(f"{name} is not a JSON number")


def _arguments_for_template(value: object, where: str) -> Any:
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise _bad(where, "must be a string of JSON")
    try:
        parsed = json.loads(value, parse_constant=no_json_constant, parse_float=_finite_float)
    except ValueError:
        return value  # not JSON (or NaN, Infinity, 1e400: no float): the template gets the text
    return parsed if isinstance(parsed, dict) else value


def parse_tool_calls(value: object, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` for the template (``arguments`` read into an object)."""
    if not isinstance(value, list) or not value:
        raise _bad(where, "must be a non-empty array of tool calls")
    out = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            raise _bad(at, 'must be {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}')
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{at}.function", "must be an object with 'name' and 'arguments'")
        call_id = item.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise _bad(f"{at}.id", "must be a string")
        function = {
            "name": _name(fn.get("name"), f"{at}.function.name"),
            "arguments": _arguments_for_template(fn.get("arguments", "{}"), f"{at}.function.arguments"),
        }
        call: dict[str, Any] = {"type": "function", "function": function}
        if call_id is not None:
            call["id"] = call_id
        out.append(call)
    return out


def parse_tool_call_id(value: object, where: str) -> str:
    """A tool message's ``tool_call_id``."""
    if not isinstance(value, str) or not value:
        raise _bad(where, "must be a non-empty string (the id of the call this answers)")
    return value


def parse_template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs``: more variables for the chat template (``{"enable_thinking": false}``)."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad("chat_template_kwargs", "must be an object of template variables")
    taken = sorted(set(value) & ChatTemplate.reserved_variables)
    if taken:
        raise _bad(f"chat_template_kwargs.{taken[0]}", "is set by the server, not by the request")
    return dict(value)
