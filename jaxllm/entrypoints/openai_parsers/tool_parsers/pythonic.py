"""vLLM's `pythonic` tool-call format (Llama 3.2/4, ToolACE and other models that write calls
as Python):

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

The output is one Python list of calls with keyword arguments that are literals (optionally
inside Llama 4's <|python_start|>...<|python_end|>); the arguments become JSON. Output that
does not start with the list is content, and so is the text from the first item that is not
such a call.
"""

from __future__ import annotations

import ast
import json
import re

from jaxllm.entrypoints.openai_parsers.tool_parsers.base import Scan, ToolParser, with_tail

START, END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        if not final and START.startswith(body):
            return Scan("")
        at = len(text) - len(body)
        if body.startswith(START):
            at += len(START) + len(body[len(START):]) - len(body[len(START):].lstrip())
        if not text.startswith("[", at):
            return Scan(text)
        s, pos = Scan(""), at + 1
        for end in _call_ends(text, at):
            call = _call(text[pos:end].strip().lstrip(",").strip())
            if call is None:
                return with_tail(s, text, pos)
            s.calls.append(call)
            pos = end
        if not final or text[pos:].strip().removesuffix(END).strip() == "]":
            return s
        return with_tail(s, text, pos)


def _call_ends(text: str, at: int):
    """Ends of the complete top-level calls of the list opening at text[at]: the index after
    each call's closing parenthesis, tracking brackets and string literals."""
    depth, quote, i = 0, None, at + 1
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = None
        elif ch in "'\"":
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote) - 1
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0 and ch == ")":
                yield i + 1
            elif depth < 0:
                return
        i += 1


def _call(src: str):
    """"f(a=1, b='x')" -> ("f", '{"a": 1, "b": "x"}'), or None if it is not such a call."""
    try:
        node = ast.parse(src, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        return None
    name = ast.unparse(node.func)
    if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
        return None
    try:
        args = {k.arg: _literal(k.value) for k in node.keywords}
    except (ValueError, TypeError, SyntaxError):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _literal(node):
    """A Python literal as JSON data (True/False/None become true/false/null)."""
    value = ast.literal_eval(node)
    json.dumps(value)  # tuples become lists; sets and bytes raise TypeError
    return value


class Llama4PythonicToolParser(PythonicToolParser):
    """vLLM's `llama4_pythonic`: Llama 4's calls in <|python_start|>[...]<|python_end|>, which
    `pythonic` reads already."""
    name = "llama4_pythonic"
