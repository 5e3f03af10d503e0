"""The host-side description of one request's output constraint, as vLLM spells it.

vLLM has had three spellings and users still send all of them: the OpenAI `response_format`
(`json_object`, `json_schema`), the pre-0.12 request fields `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` / `guided_whitespace_pattern` / `guided_decoding_backend`,
and the current `structured_outputs: {"json": ...}` object. `from_request` maps every one onto a
single `StructuredOutputsParams` so that nothing downstream knows which was used, and raises a
ValueError naming the field for anything invalid, unsupported or conflicting (two constraints
in one request are refused rather than one silently winning).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any, Optional, Union

from jaxllm.json_object import json_object

# vLLM's backend names. Only llguidance is installed (see backend.py for why); "guidance" is
# vLLM's name for it and "auto" picks it. The others are refused by name.
BACKENDS = ("auto", "guidance", "llguidance")
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class ReasoningGate:
    """Where a constraint starts when the model reasons first (vLLM applies structured output
    after the reasoning; the server builds this from its --reasoning-parser): `close`, the
    token ids that end the reasoning, and `open`, the one that begins it. `inside`: the prompt
    left the reasoning open (the model is in it from its first token), so the constraint waits
    for `close`. Otherwise the first token may be `open` (then the constraint waits for
    `close`) or any token the constraint allows (then there is no reasoning)."""
    close: tuple[int, ...]
    open: Optional[int] = None
    inside: bool = False

    def __post_init__(self):
        object.__setattr__(self, "close", tuple(int(t) for t in self.close))
        if not self.close or (self.open is None and not self.inside):
            raise ValueError("a reasoning gate needs the closing tokens, and the opening one "
                             "unless the prompt opened the reasoning")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams` (and, by its older name, `GuidedDecodingParams`).
    Exactly one of json / regex / choice / grammar / json_object is set. `json` is kept as
    canonical JSON text so that the object is hashable and equal schemas share one compiled
    grammar."""
    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None
    backend: Optional[str] = None
    # jaxllm's: the constraint starts after the model's reasoning (not a request field: the
    # server sets it from its reasoning parser; offline callers may set it themselves).
    after_reasoning: Optional[ReasoningGate] = None

    def __post_init__(self):
        set_ = lambda name: getattr(self, name) not in (None, False)
        given = [name for name in _CONSTRAINTS if set_(name)]
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of json, regex, choice, "
                             f"grammar or json_object; got {given or 'none'}")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json, "json"))
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str)
                                         or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty string, got "
                             f"{self.grammar!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str):
                raise ValueError("structured_outputs.whitespace_pattern must be a string, got "
                                 f"{self.whitespace_pattern!r}")
            if self.json is None and not self.json_object:
                raise ValueError("structured_outputs.whitespace_pattern applies only to json "
                                 "or json_object")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"structured outputs backend {self.backend!r} is not available; "
                             f"choose one of {list(BACKENDS)}")

    @property
    def kind(self) -> str:
        """Which constraint this is: 'json', 'regex', 'choice', 'grammar' or 'json_object'."""
        return next(n for n in _CONSTRAINTS if getattr(self, n) not in (None, False))

    @classmethod
    def from_dict(cls, d: Any, where: str = "structured_outputs") -> "StructuredOutputsParams":
        """From the JSON object of a request's `structured_outputs` field; unknown keys are
        refused by name."""
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be an object, got {d!r}")
        known = {f.name for f in fields(cls)} - {"backend", "after_reasoning"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where} has unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


GuidedDecodingParams = StructuredOutputsParams  # vLLM < 0.12's name for the same object

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def from_request(body: dict, default_backend: Optional[str] = None
                 ) -> Optional[StructuredOutputsParams]:
    """The constraint of an OpenAI-style request body (completions or chat), or None.

    Reads `response_format`, the `guided_*` fields and `structured_outputs`; at most one of them
    may carry a constraint. `guided_decoding_backend` (else `default_backend`, the server's
    flag) must name an available backend. Every error is a ValueError naming the field."""
    found: list[tuple[str, dict]] = []
    rf = body.get("response_format")
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    for field_name, key in _GUIDED.items():
        if body.get(field_name) is not None:
            found.append((field_name, {key: body[field_name]}))
    if body.get("structured_outputs") is not None:
        so = body["structured_outputs"]
        if not isinstance(so, dict):
            raise ValueError(f"structured_outputs must be an object, got {so!r}")
        found.append(("structured_outputs", dict(so)))
    ws = body.get("guided_whitespace_pattern")
    backend = body.get("guided_decoding_backend") or default_backend
    if not found:
        for name in ("guided_whitespace_pattern", "guided_decoding_backend"):
            if body.get(name) is not None:
                raise ValueError(f"{name} was given without a constraint (guided_json, "
                                 "guided_regex, guided_choice, guided_grammar, response_format "
                                 "or structured_outputs)")
        return None
    if len(found) > 1:
        raise ValueError("conflicting structured output fields: "
                         f"{', '.join(name for name, _ in found)}; give only one")
    name, spec = found[0]
    if ws is not None:
        if spec.get("whitespace_pattern") is not None:
            raise ValueError("guided_whitespace_pattern conflicts with "
                             "structured_outputs.whitespace_pattern")
        spec["whitespace_pattern"] = ws
    try:
        params = StructuredOutputsParams.from_dict(spec, name)
        if backend is not None:
            params = replace(params, backend=backend)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return params


def _response_format(rf: Any) -> Optional[dict]:
    """OpenAI's response_format -> a structured_outputs dict (None for plain text)."""
    if not isinstance(rf, dict) or "type" not in rf:
        raise ValueError(f"response_format must be an object with a 'type', got {rf!r}")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema' "
                             f"(type json_schema), got {js!r}")
        # vLLM reads `schema`; some clients send the OpenAI SDK's `json_schema.schema_`.
        schema = js.get("schema", js.get("schema_"))
        if schema is None:
            raise ValueError("response_format.json_schema.schema is required")
        if not isinstance(schema, dict):
            raise ValueError(f"response_format.json_schema.schema must be an object, got "
                             f"{schema!r}")
        return {"json": schema}
    raise ValueError(f"response_format.type {kind!r} is not supported; use text, json_object "
                     "or json_schema")


def _schema_text(schema: Any, name: str) -> str:
    """A JSON schema given as text, a dict or a pydantic model class -> canonical JSON text."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    schema = json_object(schema, f"structured_outputs.{name}", "JSON schema object")
    if schema is None:
        raise ValueError(f"structured_outputs.{name} must be a JSON schema object, got None")
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))

