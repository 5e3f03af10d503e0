"""Every request spelling vLLM accepts for structured output maps onto one
StructuredOutputsParams; anything invalid or conflicting is a ValueError naming the field."""

import json

import pytest

from jaxllm.structured_output import GuidedDecodingParams, StructuredOutputsParams, from_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "m", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": r"\d+"}, StructuredOutputsParams(regex=r"\d+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputsParams(grammar='root ::= "x"')),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
     StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?")),
    ({"guided_regex": "x", "guided_decoding_backend": "guidance"},
     StructuredOutputsParams(regex="x", backend="guidance")),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutputsParams(choice=["x"])),
    ({"structured_outputs": {"regex": "y"}}, StructuredOutputsParams(regex="y")),
    ({"structured_outputs": {"grammar": "start: /z/"}},
     StructuredOutputsParams(grammar="start: /z/")),
    ({"response_format": {"type": "text"}}, None),
    ({}, None),
])
def test_every_spelling(body, expected):
    assert from_request(body) == expected


def test_schema_spellings_are_one_key():
    a = StructuredOutputsParams(json=SCHEMA)
    b = GuidedDecodingParams(json=json.dumps(SCHEMA, indent=2))
    assert a == b and hash(a) == hash(b) and a.kind == "json"


def test_pydantic_model_and_server_default_backend():
    pydantic = pytest.importorskip("pydantic", reason="the offline API accepts a model class")

    class Item(pydantic.BaseModel):
        name: str
        qty: int

    p = StructuredOutputsParams(json=Item)
    assert json.loads(p.json)["required"] == ["name", "qty"]
    assert from_request({"guided_regex": "x"}, default_backend="auto").backend == "auto"


@pytest.mark.parametrize("body, words", [
    ({"guided_json": SCHEMA, "guided_regex": "x"}, "guided_json, guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "x"}},
     "response_format, structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "json_schema.schema is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type 'xml'"),
    ({"response_format": "json"}, "response_format must be an object"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"guided_json": [1]}, "JSON schema object"),
    ({"guided_choice": []}, "choice must be a non-empty list"),
    ({"guided_choice": ["a", 1]}, "choice must be a non-empty list"),
    ({"guided_regex": 5}, "regex must be a string"),
    ({"guided_grammar": "  "}, "grammar must be a non-empty string"),
    ({"guided_regex": "x", "guided_decoding_backend": "xgrammar"}, "backend 'xgrammar'"),
    ({"guided_regex": "x", "guided_whitespace_pattern": " "}, "whitespace_pattern applies only"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern was given without"),
    ({"guided_decoding_backend": "auto"}, "guided_decoding_backend was given without"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "x"}}, "exactly one of"),
    ({"structured_outputs": {}}, "exactly one of"),
    ({"structured_outputs": {"jsn": SCHEMA}}, "unknown field.*jsn"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag is not supported"),
    ({"structured_outputs": "json"}, "structured_outputs must be an object"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "},
      "guided_whitespace_pattern": " "}, "guided_whitespace_pattern conflicts"),
])
def test_errors_name_the_field(body, words):
    with pytest.raises(ValueError, match=words):
        from_request(body)


def test_sampling_params_field_and_its_older_name():
    """SamplingParams.structured_outputs (vLLM 0.32) and guided_decoding (older vLLM) are one
    field: either spelling sets both; two different constraints are refused."""
    from jaxllm import GuidedDecodingParams as G, SamplingParams
    c = G(regex="a+")
    for sp in (SamplingParams(structured_outputs=c), SamplingParams(guided_decoding=c)):
        assert sp.structured_outputs == c and sp.guided_decoding == c
    assert SamplingParams().structured_outputs is None
    assert SamplingParams(structured_outputs={"choice": ["x"]}).structured_outputs == \
        G(choice=["x"])
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(structured_outputs=c, guided_decoding=G(regex="b"))
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="a+")
