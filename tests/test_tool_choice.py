"""tool_choice "required" / a named function as structured output constraints, and the calls
read back from the constrained output (the backend's walks over these schemas are in
test_grammar_backend.py; the default model answering through them, in test_default_model_tools.py).
"""

import json

import jsonschema
import pytest

from jaxllm.structured_output.backend import get_compiler
from jaxllm.structured_output.tool_choice import calls_from_output, tool_choice_params

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_none_and_auto_need_no_constraint():
    for choice in (None, "none", "auto"):
        assert tool_choice_params(TOOLS, choice) is None


def test_named_function_is_its_parameters_schema():
    assert json.loads(tool_choice_params(TOOLS, NAMED).json) == WEATHER
    assert calls_from_output('{"city": "Paris"}', NAMED) == [("get_weather",
                                                              '{"city": "Paris"}')]


def test_required_is_an_array_of_calls():
    schema = json.loads(tool_choice_params(TOOLS, "required").json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert all(item["additionalProperties"] is False and item["required"] == ["name", "parameters"]
               for item in schema["items"]["anyOf"])
    assert names == [["get_time"], ["get_weather"]] or names == [["get_weather"], ["get_time"]]
    single = json.loads(tool_choice_params(TOOLS, "required", parallel_tool_calls=False).json)
    assert single["maxItems"] == 1
    out = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": ' \
          '{"city": "Paris"}}]'
    assert calls_from_output(out, "required") == [("get_time", "{}"),
                                                  ("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("tools, choice, words", [
    (TOOLS, {"type": "function", "function": {"name": "get_news"}}, "'get_news', which is not"),
    ([], "required", "needs at least one tool"),
    (None, NAMED, "'get_weather', which is not"),
    (TOOLS, "always", "tool_choice must be"),
    (TOOLS, {"function": {"name": "get_weather"}}, "tool_choice must be"),
    ([{"type": "retrieval"}], "required", r"tools\[0\] must be"),
    (["get_weather"], "required", r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "required",
     r"tools\[0\].function.parameters"),
])
def test_errors_name_the_field(tools, choice, words):
    with pytest.raises(ValueError, match=words):
        tool_choice_params(tools, choice)


@pytest.mark.parametrize("text, choice", [
    ('[{"name": "get_weather", "parameters": {"city": "Pa', "required"),
    ('{"name": "get_weather"}', "required"),
    ('[1]', "required"),
    ('[]x', NAMED),
    ('[]', NAMED),
])
def test_unparsable_output_is_an_error(text, choice):
    with pytest.raises(ValueError, match="tool call output"):
        calls_from_output(text, choice)


@pytest.fixture(scope="module")
def smollm2_compiler():
    from jaxllm.tokenizer import get_tokenizer

    tok = get_tokenizer(None)
    return tok, get_compiler(tok)


def accepted(compiler_and_tok, params, text: str) -> bool:
    """Whether llguidance, constrained by `params`, takes the whole of `text` (and may end)."""
    tok, compiler = compiler_and_tok
    tokens = tok.encode(text, add_special_tokens=False)
    m = compiler.matcher(params)
    return m.validate_tokens(tokens) == len(tokens) and m.accept_tokens(tokens) \
        and m.is_accepting()


CALL = '[{"name":"get_weather","parameters":{"city":"Paris"}}]'


@pytest.mark.parametrize("text", [
    '[{"name":"get_weather","parameters":{"city":"Paris"},"description":"Paris"}]',
    '[{"name":"get_weather","parameters":{"city":"Paris","temperature":"22.5"}}]',
    '[{"name":"get_time","parameters":{"zone":"UTC"}}]',
    '[{"name":"get_news","parameters":{}}]',
])
def test_required_takes_no_key_beside_name_parameters_and_the_schemas(smollm2_compiler, text):
    """The keys SmolLM2 added until max_tokens (issue 41) are not in the grammar any more."""
    params = tool_choice_params(TOOLS, "required")
    assert accepted(smollm2_compiler, params, CALL)
    assert accepted(smollm2_compiler, params, '[{"name":"get_time","parameters":{}}]')
    assert not accepted(smollm2_compiler, params, text)


def test_required_schema_itself_rejects_extra_keys():
    schema = json.loads(tool_choice_params(TOOLS, "required").json)
    jsonschema.validate(json.loads(CALL), schema)
    for extra in ('[{"name":"get_weather","parameters":{"city":"Paris"},"x":1}]',
                  '[{"name":"get_weather"}]', '[]'):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(extra), schema)


def test_named_arguments_are_closed_unless_the_schema_opens_them(smollm2_compiler):
    params = tool_choice_params(TOOLS, NAMED)
    assert accepted(smollm2_compiler, params, '{"city":"Paris"}')
    assert not accepted(smollm2_compiler, params, '{"city":"Paris","days":2}')
    open_weather = {**WEATHER, "additionalProperties": {"type": "integer"}}
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": open_weather}}]
    assert accepted(smollm2_compiler, tool_choice_params(tools, NAMED), '{"city":"Paris","days":2}')


PLACE = {"$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]}},
         "type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}}, "required": ["at"]}


def test_required_moves_the_tools_defs_to_the_root(smollm2_compiler):
    """Under the array, a tool's "#/$defs/..." would resolve against the wrapper."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PLACE}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 **PLACE, "properties": {"near": {"$ref": "#/$defs/Place"}},
                 "required": ["near"]}}}]
    params = tool_choice_params(tools, "required")
    schema = json.loads(params.json)
    assert schema["$defs"] == PLACE["$defs"]
    call = '[{"name":"get_time","parameters":{"near":{"city":"Paris"}}}]'
    jsonschema.validate(json.loads(call), schema)
    assert accepted(smollm2_compiler, params, call)
    assert not accepted(smollm2_compiler, params, call.replace('"city"', '"town"'))
    clash = [tools[0], {"type": "function", "function": {"name": "get_time", "parameters": {
        **PLACE, "$defs": {"Place": {"type": "string"}}}}}]
    with pytest.raises(ValueError, match=r"\$defs 'Place'"):
        tool_choice_params(clash, "required")
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"$defs": []}}}]
    with pytest.raises(ValueError, match="the \\$defs of tool 'f'"):
        tool_choice_params(bad, "required")
