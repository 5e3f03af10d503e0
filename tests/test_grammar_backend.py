"""The llguidance backend on the real SmolLM2 tokenizer: masks in the sampler's layout, random
walks through allowed tokens that always end in text matching the constraint, the cache, errors.
"""

import json
import re

import numpy as np
import pytest

from jaxllm.structured_output import StructuredOutputsParams as P
from jaxllm.structured_output.backend import GrammarError, fill_banned_bits, get_compiler

jsonschema = pytest.importorskip("jsonschema", reason="validates the walks' JSON")

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 5},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "active": {"type": "boolean"}},
     "required": ["name", "age", "role", "address"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 1, "maxItems": 4},
]
REGEXES = [r"\d{4}-\d{2}-\d{2}", r"\(\d{3}\) \d{3}-\d{4}", r"(cat|dog)s?"]
CHOICES = ["positive", "negative", "neutral ☺"]
GBNF = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"'


@pytest.fixture(scope="module")
def tok():
    from jaxllm.tokenizer import get_tokenizer
    return get_tokenizer(None)


@pytest.fixture(scope="module")
def texts(tok):
    return [tok.decode([i]) for i in range(len(tok))]


@pytest.fixture(scope="module")
def compiler(tok):
    return get_compiler(tok)


def _allowed(bits_row, vocab):
    return np.flatnonzero(np.unpackbits(~bits_row.view(np.uint8), bitorder="little")[:vocab])


def _walk(compiler, tok, params, rng, texts, max_steps=300):
    """Samples uniformly among allowed tokens; after 30 steps prefers EOS, then closing
    tokens, then single non-space characters, so that unbounded strings and numbers end.
    Returns the text, or None if the walk did not end within max_steps."""
    closing = np.array([t in ('"', "}", "]", ",", ")") for t in texts] + [False] * 64)
    single = np.array([len(t) == 1 and not t.isspace() for t in texts] + [False] * 64)
    m = compiler.matcher(params)
    bits = np.zeros((3, -(-compiler.vocab_size // 32)), np.uint32)
    eos, out = tok.eos_token_id, []
    for step in range(max_steps):
        fill_banned_bits([(m, 1)], bits)
        allowed = _allowed(bits[1], compiler.vocab_size)
        assert len(allowed) > 0
        assert not bits[0].any() and not bits[2].any()  # other rows untouched
        if step > 30 and eos in allowed:
            t = eos
        elif step > 30:
            pick = next((c for c in (allowed[closing[allowed]], allowed[single[allowed]])
                         if len(c)), allowed)
            t = int(rng.choice(pick))
        else:
            t = int(rng.choice(allowed))
        assert m.accept(t), m.error
        if t == eos:
            assert m.is_terminated()
            return tok.decode(out)
        out.append(t)
    return None


def test_masks_json_schema_walks_validate(compiler, tok, texts):
    rng = np.random.default_rng(0)
    for schema in SCHEMAS:
        done = 0
        for _ in range(6):
            text = _walk(compiler, tok, P(json=schema), rng, texts)
            if text is not None:
                jsonschema.validate(json.loads(text), schema)
                done += 1
        assert done >= 5


def test_json_object_always_parses(compiler, tok, texts):
    rng = np.random.default_rng(1)
    outs = [_walk(compiler, tok, P(json_object=True), rng, texts) for _ in range(5)]
    assert sum(t is not None for t in outs) >= 4
    for t in filter(None, outs):
        assert isinstance(json.loads(t), dict)


def test_regex_choice_and_gbnf_always_match(compiler, tok, texts):
    rng = np.random.default_rng(2)
    cases = [(P(regex=r), lambda s, r=r: re.fullmatch(r, s)) for r in REGEXES]
    cases.append((P(choice=CHOICES), lambda s: s in CHOICES))

    def arithmetic(s):
        depth = 0
        for i, ch in enumerate(s):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth < 0 or ch not in "0123456789+()":
                return False
        return depth == 0 and re.fullmatch(r"[0-9()+]*", s) and "++" not in s and s[0] != "+"

    cases.append((P(grammar=GBNF), arithmetic))
    for params, check in cases:
        for _ in range(4):
            text = _walk(compiler, tok, params, rng, texts)
            assert text is not None and check(text), (params.kind, text)


def test_choice_first_mask_is_exactly_the_choice_prefixes(compiler, tok, texts):
    m = compiler.matcher(P(choice=["yes", "no"]))
    bits = np.zeros((1, -(-compiler.vocab_size // 32)), np.uint32)
    fill_banned_bits([(m, 0)], bits)
    allowed = set(_allowed(bits[0], compiler.vocab_size).tolist())
    expected = {t for t, s in enumerate(texts) if s and any(c.startswith(s) for c in ("yes", "no"))}
    assert allowed == expected


def test_batch_fill_rows_and_dead_end(compiler, tok):
    ms = [compiler.matcher(P(choice=["yes", "no"])) for _ in range(64)]
    bits = np.zeros((65, -(-compiler.vocab_size // 32)), np.uint32)
    bits[64] = 7  # a grammar-free row's own bans stay
    fill_banned_bits([(m, i) for i, m in enumerate(ms)], bits)
    assert (bits[:64] == bits[0]).all() and (bits[64] == 7).all()
    # A forbidden token puts the matcher in an error state: only EOS remains, never a hang.
    bad = tok.encode("maybe")[0]
    assert not ms[0].accept(bad) and ms[0].is_error() and ms[0].error
    fill_banned_bits([(ms[0], 0)], bits)
    assert _allowed(bits[0], compiler.vocab_size).tolist() == [tok.eos_token_id]


def test_rollback_and_validate(compiler, tok):
    m = compiler.matcher(P(regex=r"ab(c|d)"))
    ids = tok.encode("abc")
    assert m.validate_tokens(ids) == len(ids)
    assert m.accept_tokens(ids) and m.is_accepting()
    m.rollback(1)
    assert not m.is_accepting() and m.accept_tokens(tok.encode("abd")[len(ids) - 1:])


def test_compile_cache_and_errors(compiler):
    a = compiler.compile(P(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = compiler.compile(P(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'))
    assert a is b and compiler.compile(P(json_object=True)) is not a
    for bad, words in ((P(regex="a(b"), "regex"), (P(grammar="root ::= missing"), "missing"),
                       (P(json={"type": "foo"}), "foo")):
        with pytest.raises(GrammarError, match=words):
            compiler.compile(bad)


def test_layout_checked(compiler):
    m = compiler.matcher(P(json_object=True))
    with pytest.raises(ValueError, match="does not fit"):
        fill_banned_bits([(m, 0)], np.zeros((1, 10), np.uint32))
    with pytest.raises(ValueError, match="uint32"):
        fill_banned_bits([(m, 0)], np.zeros((1, 1536), np.int32))


def test_json_options_are_honoured(compiler, tok, texts):
    """disable_any_whitespace: no whitespace outside strings; disable_additional_properties:
    objects without an explicit additionalProperties take no other keys; whitespace_pattern:
    only the given whitespace."""
    rng = np.random.default_rng(3)
    open_schema = {"type": "object", "properties": {"k": {"enum": ["a b", "c"]}},
                   "required": ["k"]}
    for params, check in (
            (P(json=open_schema, disable_any_whitespace=True),
             lambda s: not any(ch.isspace() for ch in _outside_strings(s))),
            (P(json=open_schema, disable_additional_properties=True),
             lambda s: set(json.loads(s)) == {"k"}),
            (P(json=open_schema, whitespace_pattern="[ ]?"),
             lambda s: not any(ch in "\n\t\r" for ch in _outside_strings(s)))):
        for _ in range(3):
            text = _walk(compiler, tok, params, rng, texts)
            assert text is not None and check(text), (params, text)
            jsonschema.validate(json.loads(text), open_schema)


def test_default_json_whitespace_is_bounded(compiler, tok):
    """By default a gap between JSON tokens takes nothing, one space, or one newline and an
    indentation (BOUNDED_WHITESPACE), never a run of newlines; whitespace_pattern replaces it
    and disable_any_whitespace allows none."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "string", "maxLength": 12}},
              "required": ["a", "b"], "additionalProperties": False}

    def accepts(params, text):
        m = compiler.matcher(params)
        return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) \
            and not m.is_error()

    default = P(json=schema)
    for text in ('{"a":1,"b":"x"}', '{"a": 1, "b": "x"}', '{\n  "a": 1,\n  "b": "x"\n}'):
        assert accepts(default, text), text
    for text in ('{\n\n"a"', '{"a":  1', '{ \n "a"', '{' + "\n" + " " * 40 + '"a"'):
        assert not accepts(default, text), text
    assert accepts(P(json=schema, whitespace_pattern="[ \n]*"), '{\n\n\n"a"')
    assert not accepts(P(json=schema, disable_any_whitespace=True), '{ "a"')


def _outside_strings(text):
    return re.sub(r'"(?:[^"\\]|\\.)*"', "", text)


def test_model_vocabulary_wider_than_the_tokenizer(tok):
    """Models pad their embedding past the tokenizer (e.g. Qwen2.5: 151936 rows for 151665
    tokens): the padding ids are never allowed."""
    from jaxllm.structured_output.backend import GrammarCompiler

    c = GrammarCompiler(tok, vocab_size=len(tok) + 100)
    bits = np.zeros((1, -(-c.vocab_size // 32)), np.uint32)
    fill_banned_bits([(c.matcher(P(json_object=True)), 0)], bits)
    allowed = _allowed(bits[0], c.vocab_size)
    assert len(allowed) and allowed.max() < len(tok)


def test_tool_choice_required_walks_give_valid_calls(compiler, tok, texts):
    from jaxllm.structured_output.tool_choice import calls_from_output, tool_choice_params

    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                "days": {"type": "integer", "minimum": 1,
                                                         "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {}, "additionalProperties": False}}}]
    schemas = {"get_weather": weather, "get_time": tools[1]["function"]["parameters"]}
    rng = np.random.default_rng(4)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel in (("required", True), ("required", False), (named, True)):
        params = tool_choice_params(tools, choice, parallel)
        for _ in range(3):
            text = _walk(compiler, tok, params, rng, texts)
            assert text is not None
            calls = calls_from_output(text, choice)
            assert calls and (parallel or len(calls) == 1)
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), schemas[name])


def test_a_model_with_fewer_logits_than_the_tokenizer_gets_masks_of_its_width(tok):
    """A model whose logits stop before the tokenizer's last token (the 124M bench model:
    32000 logits, SmolLM2's 49152-token tokenizer): the masks are cut to the model's width,
    and agree with the full-width ones on the tokens it has."""
    from jaxllm.structured_output.backend import GrammarCompiler
    full, cut = GrammarCompiler(tok), GrammarCompiler(tok, vocab_size=1000)
    params = P(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    wide = np.zeros((2, -(-full.vocab_size // 32)), np.uint32)
    narrow = np.zeros((2, -(-1000 // 32)), np.uint32)
    fill_banned_bits([(full.matcher(params), 1)], wide)
    fill_banned_bits([(cut.matcher(params), 1)], narrow)
    np.testing.assert_array_equal(narrow[1], wide[1, :narrow.shape[1]])
    assert (narrow[0] == 0).all() and (wide[1] != 0).any()


def test_a_grammar_no_token_can_start_is_refused_at_compile(tok):
    """With this schema llguidance allows only one first token (`{"`, id 39428 in SmolLM2's
    vocabulary); a model with 32000 logits cannot sample it. Compiling probes the first mask,
    so this is a GrammarError (a 400), not a request that dead-ends at once."""
    from jaxllm.structured_output.backend import GrammarCompiler
    schema = {"type": "object", "properties": {"values": {"type": "array", "items": {
        "type": "integer"}, "minItems": 1000}}, "required": ["values"]}
    params = P(json=schema, disable_any_whitespace=True)
    assert GrammarCompiler(tok).compile(params) is not None  # the full vocabulary has it
    with pytest.raises(GrammarError, match="no token of the model's vocabulary"):
        GrammarCompiler(tok, vocab_size=32000).compile(params)
