"""Argument values written as text (Qwen3-Coder's <parameter=...>, GLM-4.5's <arg_value>),
typed by the request's tool schema as vLLM's parsers type them."""

from __future__ import annotations

import ast
import json
from typing import Any

_STRING = ("string", "str", "text", "varchar", "char", "enum")
_INT = ("int", "uint", "long", "short", "unsigned")


def schema_type(prop) -> str:
    """The JSON-schema type of one property, lower case ("string" where it names none; the
    first non-null type of a list such as ["integer", "null"])."""
    kind = prop.get("type", "string") if isinstance(prop, dict) else "string"
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower()


def literal(value: str) -> Any:
    """`value` as JSON, else as a Python literal (a model may write True or single quotes),
    else the text itself. Only results that are JSON themselves count."""
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        out = ast.literal_eval(value)
        json.dumps(out)
        return out
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


def qwen3_coder_value(value: str, prop) -> Any:
    """vLLM's qwen3_coder rules: "null" is null; a property the schema does not list, or a
    string-like type, is the text; integers, numbers and booleans by their type (the text where
    it does not read as one); objects, arrays and anything else as JSON or a literal."""
    if value.lower() == "null":
        return None
    if prop is None:
        return value
    kind = schema_type(prop)
    if kind in _STRING:
        return value
    if kind.startswith(_INT):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    return literal(value)


def glm45_value(value: str, prop) -> Any:
    """vLLM's glm45 rules: the text of a property the schema types as a string, else the value
    read as JSON or a literal (the text if neither)."""
    if prop is not None and schema_type(prop) == "string":
        return value
    return literal(value)
