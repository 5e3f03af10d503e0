"""Structured output on the real default model (SmolLM2-135M-Instruct): every constrained
output parses and validates against its schema, regex, choice list or grammar. One batched
`LLM.chat` per test; the 50-request JSON-schema run is marked slow, a 10-request one runs by
default."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.structured_output import StructuredOutputsParams as SO

SCHEMAS = [
    # nested objects, required fields, bounded integer
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["name", "address"], "additionalProperties": False},
    # array of enums with bounds on its length
    {"type": "object", "properties": {
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                    "minItems": 1, "maxItems": 3}},
     "required": ["colours"], "additionalProperties": False},
    # bounded numbers and a boolean
    {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"}},
     "required": ["age", "score", "active"], "additionalProperties": False},
    # an enum and an optional field
    {"type": "object", "properties": {
        "status": {"enum": ["open", "closed", "pending"]},
        "note": {"type": "string", "maxLength": 16}},
     "required": ["status"], "additionalProperties": False},
    # an array of small objects
    {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 99},
                "tag": {"enum": ["a", "b"]}},
            "required": ["id", "tag"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256,
               use_tqdm_on_load=False, disable_log_stats=True)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def run_schemas(llm, per_schema: int):
    convs, params, schemas = [], [], []
    for k, schema in enumerate(SCHEMAS):
        for i in range(per_schema):
            convs.append(ask(f"Reply in JSON that fits this schema: {json.dumps(schema)}"))
            # Flexible whitespace (the default, as vLLM's) lets a 135M model sampled at 0.8
            # pad with newlines until max_tokens now and then; compact JSON cannot.
            params.append(SamplingParams(temperature=0.8, seed=100 * k + i, max_tokens=120,
                                         structured_outputs=SO(json=schema,
                                                               disable_any_whitespace=True)))
            schemas.append(schema)
    outs = llm.chat(convs, params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), schema)


def test_json_schemas_validate(llm):
    run_schemas(llm, per_schema=1)


@pytest.mark.slow
def test_fifty_json_schema_requests_validate(llm):
    run_schemas(llm, per_schema=10)


@pytest.mark.parametrize("so, prompt, check", [
    (SO(regex=r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
     "What is today's date? Answer as YYYY-MM-DD.",
     lambda t: re.fullmatch(r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", t)),
    (SO(regex=r"\(\d{3}\) \d{3}-\d{4}"), "Give me a US phone number.",
     lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t)),
    (SO(choice=["positive", "negative", "neutral"]),
     "Sentiment of 'I love this movie'?", lambda t: t in ("positive", "negative", "neutral")),
    (SO(grammar='root ::= "The answer is " [0-9]+ "."'), "What is 6 times 7?",
     lambda t: re.fullmatch(r"The answer is \d+\.", t)),
    (SO(json_object=True, disable_any_whitespace=True),
     'Give a JSON object with the keys "name" and "age" of a cat.',
     lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_grammar_json_object(llm, so, prompt, check):
    sps = [SamplingParams(temperature=0.8, seed=i, max_tokens=100, structured_outputs=so)
           for i in range(4)]
    for out in llm.chat([ask(prompt)] * 4, sps, use_tqdm=False):
        o = out.outputs[0]
        assert o.finish_reason == "stop" and check(o.text), (o.finish_reason, o.text)


BOUNDED = {"type": "object", "properties": {"a": {"type": "integer"},
                                            "b": {"type": "string", "maxLength": 12}},
           "required": ["a", "b"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"]}}}]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["json_schema", "json_object", "tool_choice_required"])
def test_two_hundred_sampled_requests_finish_their_json(llm, kind):
    """The default whitespace is bounded (no disable_any_whitespace here): 200 requests
    sampled at 0.7 with max_tokens 64 all close their JSON, which parses and validates."""
    from jaxllm.structured_output.tool_choice import calls_from_output, tool_choice_params

    so, prompt = {
        "json_schema": (SO(json=BOUNDED), "Reply in JSON with an integer a and a short string b."),
        "json_object": (SO(json_object=True),
                        'Give a JSON object with the keys "name" and "age" of a cat.'),
        "tool_choice_required": (tool_choice_params(WEATHER, "required"),
                                 "What is the weather in Paris? Call the tool."),
    }[kind]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=64, structured_outputs=so)
              for i in range(200)]
    outs = [out.outputs[0] for out in llm.chat([ask(prompt)] * 200, params, use_tqdm=False)]
    for o in outs:  # one gap holds one space, or one newline and at most 32 blanks
        gaps = re.findall(r"\s+", re.sub(r'"(?:[^"\\]|\\.)*"', "s", o.text))
        assert all(g == " " or (g[0] == "\n" and "\n" not in g[1:] and len(g) <= 33)
                   for g in gaps), o.text
    if kind != "json_schema":
        # An object's content and an array of calls are unbounded: a sampled 135M model
        # sometimes writes a long string value, or calls again, until max_tokens ("length",
        # which the OpenAI client's .parse raises as LengthFinishReasonError), never
        # whitespace; every finished one parses.
        done = sum(o.finish_reason == "stop" for o in outs)
        assert done >= 180, done
        outs = [o for o in outs if o.finish_reason == "stop"]
    for o in outs:
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        if kind == "json_schema":
            jsonschema.validate(json.loads(o.text), BOUNDED)
        elif kind == "json_object":
            assert isinstance(json.loads(o.text), dict), o.text
        else:
            calls = calls_from_output(o.text, "required")
            assert calls and all(name == "get_weather" for name, _ in calls), o.text
            for _, args in calls:
                jsonschema.validate(json.loads(args), WEATHER[0]["function"]["parameters"])
