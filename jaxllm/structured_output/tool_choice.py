"""`tool_choice` "required" and a named function through structured output, as vLLM does it:
the constraint makes the model write the calls as JSON that fits the tools' parameter schemas,
so the arguments always parse and validate, whatever the model and its tool-call format.

  named function   the output is that function's arguments object (its `parameters` schema)
  "required"       the output is a JSON array of {"name": <a tool's name>, "parameters": {...}}
                   with at least one item (exactly one when parallel_tool_calls is false)

Both are closed, as vLLM's default grammar backend (xgrammar, strict mode) closes them: a call
has no keys beside name and parameters, and the arguments no keys their schema does not name
(unless it says so with its own additionalProperties). Left open, a small model (SmolLM2)
invents keys - "temperature", "windSpeedInCelsius", ... - until max_tokens and never finishes
a call.

`tool_choice_params` builds the constraint, `calls_from_output` turns the constrained output
into (name, arguments JSON) pairs. "none" and "auto" need no constraint ("auto" is the tool
parser's job). The JSON is compact (no optional whitespace): calls are read by programs, and a
model left free to write whitespace can spend its whole token budget on it.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from jaxllm.structured_output.params import StructuredOutputsParams

_EMPTY = {"type": "object", "properties": {}}


def tool_choice_params(tools: Optional[list], tool_choice: Any,
                       parallel_tool_calls: bool = True) -> Optional[StructuredOutputsParams]:
    """The constraint for a request's tools and tool_choice, or None. Raises a ValueError
    naming the field for a tool_choice that the tools cannot satisfy."""
    if tool_choice in (None, "none", "auto"):
        return None
    functions = _functions(tools)
    if tool_choice == "required":
        if not functions:
            raise ValueError('tool_choice "required" needs at least one tool in tools')
        return _closed(_calls_schema(functions, parallel_tool_calls))
    name = _named(tool_choice)
    if name not in functions:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                         f"({sorted(functions)})")
    return _closed(functions[name])


def _closed(schema: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                   disable_additional_properties=True)


def _calls_schema(functions: dict[str, dict], parallel: bool) -> dict:
    """vLLM's array of calls: each item one tool's {"name", "parameters"} and nothing else.
    The tools' `$defs` move to the root, where their "#/$defs/..." references resolve (nested
    under the array they would point at nothing), as vLLM moves them."""
    defs: dict = {}
    branches = []
    for name, params in functions.items():
        params = dict(params)
        own = params.pop("$defs", {})
        if not isinstance(own, dict):
            raise ValueError(f"the $defs of tool {name!r} must be an object")
        for key, value in own.items():
            if defs.setdefault(key, value) != value:
                raise ValueError(f"tools define $defs {key!r} differently (tool {name!r}); "
                                 f"give the definitions distinct names")
        branches.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [name]},
                                        "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def calls_from_output(text: str, tool_choice: Any) -> list[tuple[str, str]]:
    """(name, arguments JSON) of each call in an output constrained by `tool_choice_params`.
    A ValueError if the output does not parse (the constraint was not applied, or the output
    was cut off by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the tool call output is not complete JSON: {e}") from None
    if tool_choice == "required":
        if not isinstance(value, list) or not all(
                isinstance(v, dict) and isinstance(v.get("name"), str) for v in value):
            raise ValueError("the tool call output is not a list of {name, parameters}")
        return [(v["name"], json.dumps(v.get("parameters", {}), ensure_ascii=False))
                for v in value]
    if not isinstance(value, dict):
        raise ValueError("the tool call output is not an arguments object")
    return [(_named(tool_choice), json.dumps(value, ensure_ascii=False))]


def _functions(tools: Optional[list]) -> dict[str, dict]:
    out = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(fn, dict) or tool.get("type", "function") != "function"
                or not isinstance(fn.get("name"), str)):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": ..., \"parameters\": ...}}}}, got {tool!r}")
        params = fn.get("parameters") or _EMPTY
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[fn["name"]] = params
    return out


def _named(tool_choice: Any) -> str:
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function"
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": '
                         f'"function", "function": {{"name": ...}}}}, got {tool_choice!r}')
    return fn["name"]
