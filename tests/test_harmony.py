"""GPT-OSS's harmony format (jaxllm/entrypoints/harmony.py) against openai-harmony's own
rendering and parsing: a conversation with reasoning, a tool call and its result renders to
the token ids of the same conversation written directly as harmony messages; a reply (analysis,
a commentary preamble, a function call) rendered by openai-harmony parses back to its
reasoning, content and call, token by token as streamed deltas that join to the same message;
and the parsed reply sent back as the next turn renders as harmony renders its own messages.

openai-harmony needs the o200k_base vocabulary: offline it comes from the bpe-openai package
(checked against tiktoken's SHA-256); where neither is installed the tests are skipped,
saying so.
"""

import json

import pytest

from jaxllm.entrypoints.harmony import (HarmonyOutputParser, HarmonyUnavailable, encoding,
                                        join_deltas, render_prompt, tool_call_message)

try:
    encoding()
    UNAVAILABLE = None
except HarmonyUnavailable as e:
    UNAVAILABLE = str(e)
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None,
                                reason=f"harmony unavailable here: {UNAVAILABLE}")

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Current weather in a city",
                                           "parameters": PARAMS}}]
ARGS = json.dumps({"city": "Paris"})


def _conversation() -> list[dict]:
    return [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "reasoning": "I should call the weather tool.", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "c": 21}'},
    ]


def test_conversation_renders_as_harmony_renders_it():
    import openai_harmony as h

    enc = encoding()
    developer = (h.DeveloperContent.new().with_instructions("Answer in one sentence.")
                 .with_function_tools([h.ToolDescription.new(
                     "get_weather", "Current weather in a city", parameters=PARAMS)]))
    want = h.Conversation.from_messages([
        h.Message.from_role_and_content(h.Role.SYSTEM,
                                        h.SystemContent.new().with_reasoning_effort(
                                            h.ReasoningEffort.LOW)),
        h.Message.from_role_and_content(h.Role.DEVELOPER, developer),
        h.Message.from_role_and_content(h.Role.USER, "What is the weather in Paris?"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "I should call the weather tool.")
        .with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, ARGS).with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("json"),
        h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, "functions.get_weather"),
                                          '{"sky": "sunny", "c": 21}')
        .with_channel("commentary").with_recipient("assistant"),
    ])
    ours = render_prompt(_conversation(), TOOLS, reasoning_effort="low")
    assert ours == list(enc.render_conversation_for_completion(want, h.Role.ASSISTANT))
    text = enc.decode(ours)
    assert "Reasoning: low" in text and "type get_weather" in text
    assert "<|channel|>analysis<|message|>I should call the weather tool." in text


def _reply_tokens(prompt: list[int], messages: list) -> list[int]:
    """The completion a model writes after `prompt` (which ends with <|start|>assistant):
    the messages as openai-harmony renders them, less that opening."""
    enc = encoding()
    tokens = [t for m in messages for t in enc.render(m)]
    assert tokens[:2] == prompt[-2:]
    return tokens[2:]


def test_reply_parses_whole_and_streamed_as_harmony_parses_it():
    import openai_harmony as h

    enc = encoding()
    prompt = render_prompt(_conversation()[:2], TOOLS)
    reply = [
        h.Message.from_role_and_content(h.Role.ASSISTANT, "The user wants the weather. "
                                        "Call get_weather with city Paris.")
        .with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Checking the weather now.")
        .with_channel("commentary"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, ARGS).with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("json"),
    ]
    tokens = _reply_tokens(prompt, reply)
    parsed = enc.parse_messages_from_completion_tokens(tokens, h.Role.ASSISTANT)
    assert [(m.channel, m.recipient) for m in parsed] == [
        ("analysis", None), ("commentary", None), ("commentary", "functions.get_weather")]

    whole = HarmonyOutputParser(call_ids=["call_a"]).whole(tokens)
    assert whole["reasoning"] == parsed[0].content[0].text
    assert whole["content"] == parsed[1].content[0].text
    assert whole["tool_calls"] == [{"index": 0, "id": "call_a", "type": "function",
                                    "function": {"name": "get_weather", "arguments": ARGS}}]

    stream = HarmonyOutputParser(call_ids=["call_a"])
    deltas = [stream.feed([t]) for t in tokens]
    assert sum(d is not None for d in deltas) > 10  # really streamed, piece by piece
    assert join_deltas(deltas) == whole

    # The parsed reply sent back (with the tool's result) renders as harmony's own messages.
    turn = _conversation()[:2] + [{**tool_call_message(whole["tool_calls"]),
                                   "reasoning": whole["reasoning"]},
                                  {"role": "tool", "tool_call_id": "call_a", "content": "21C"}]
    tool_result = (h.Message.from_author_and_content(
        h.Author.new(h.Role.TOOL, "functions.get_weather"), "21C")
        .with_channel("commentary").with_recipient("assistant"))
    want = enc.render_conversation_for_completion(
        h.Conversation.from_messages(_harmony_head() + [parsed[0], parsed[2], tool_result]),
        h.Role.ASSISTANT)
    assert render_prompt(turn, TOOLS) == list(want)


def _harmony_head() -> list:
    import openai_harmony as h

    developer = (h.DeveloperContent.new().with_instructions("Answer in one sentence.")
                 .with_function_tools([h.ToolDescription.new(
                     "get_weather", "Current weather in a city", parameters=PARAMS)]))
    return [h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new()),
            h.Message.from_role_and_content(h.Role.DEVELOPER, developer),
            h.Message.from_role_and_content(h.Role.USER, "What is the weather in Paris?")]


def test_final_answer_is_content_and_unknown_tool_result_refused():
    import openai_harmony as h

    prompt = render_prompt([{"role": "user", "content": "Hi"}])
    tokens = _reply_tokens(prompt, [
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Greet back.").with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Hello!").with_channel("final")])
    assert HarmonyOutputParser().whole(tokens) == {"reasoning": "Greet back.",
                                                   "content": "Hello!", "tool_calls": []}
    with pytest.raises(ValueError, match="call_9"):
        render_prompt([{"role": "tool", "tool_call_id": "call_9", "content": "x"}])


def _reply_text(messages: list) -> str:
    """A reply as the server's text with the special tokens kept: the tokens decoded."""
    enc = encoding()
    prompt = render_prompt([{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    return enc.decode(_reply_tokens(prompt, messages))


@pytest.mark.parametrize("reasoning_parser", ["openai_gptoss", None])
def test_server_parsers_whole_and_streamed(reasoning_parser):
    """The server's `openai_gptoss` reasoning parser and `openai` tool parser (they read the
    text with the special tokens kept, which the server then keeps) through its ChoiceParser:
    the reply's analysis is the reasoning, its preamble the content, its call the tool call;
    streamed token by token the deltas join to the same. Without the reasoning parser the
    analysis is dropped (it is neither content nor a call)."""
    import openai_harmony as h
    from types import SimpleNamespace

    from serving.serving_chat import ChoiceParser, ToolChoice, keeps_special_tokens

    reply = [h.Message.from_role_and_content(h.Role.ASSISTANT, "Call the tool.")
             .with_channel("analysis"),
             h.Message.from_role_and_content(h.Role.ASSISTANT, "Checking.")
             .with_channel("commentary"),
             h.Message.from_role_and_content(h.Role.ASSISTANT, ARGS).with_channel("commentary")
             .with_recipient("functions.get_weather").with_content_type("json")]
    enc = encoding()
    prompt = render_prompt([{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    tokens = _reply_tokens(prompt, reply)
    text = enc.decode(tokens)
    choice = ToolChoice.of(SimpleNamespace(tool_choice="auto", tools=TOOLS,
                                           parallel_tool_calls=True), "openai", True)
    state = SimpleNamespace(reasoning_parser=reasoning_parser, tool_call_parser="openai")
    assert keeps_special_tokens(state, choice)

    whole = ChoiceParser(choice, "openai", reasoning_parser).whole(text)
    assert whole["reasoning"] == ("Call the tool." if reasoning_parser else None)
    assert whole["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole["tool_calls"]] == [("get_weather", {"city": "Paris"})]

    parser = ChoiceParser(choice, "openai", reasoning_parser)
    deltas = [parser.delta(enc.decode(tokens[:i]), final=False)
              for i in range(1, len(tokens) + 1)]
    deltas.append(parser.delta(text, final=True))
    joined = join_deltas(deltas)
    assert joined["reasoning"] == whole["reasoning"] and joined["content"] == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in joined["tool_calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    # the call went out once complete, whole, in one delta
    assert sum("tool_calls" in d for d in deltas if d) == 1


def test_server_parsers_final_answer_and_malformed_output():
    import openai_harmony as h

    from jaxllm.entrypoints.openai_parsers.reasoning_parsers import get_reasoning_parser
    from jaxllm.entrypoints.openai_parsers.tool_parsers import get_tool_parser

    text = _reply_text([
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Easy.").with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Sunny.").with_channel("final")])
    reasoning, content = get_reasoning_parser("openai_gptoss")().extract(text)
    assert (reasoning, content) == ("Easy.", "Sunny.")
    assert get_tool_parser("openai")().extract(content).tool_calls == []
    # not harmony, or arguments that are not a JSON object: content, never an error
    assert get_reasoning_parser("openai_gptoss")().extract("plain words") == (None,
                                                                              "plain words")
    bad = _reply_text([h.Message.from_role_and_content(h.Role.ASSISTANT, "{not json")
                       .with_channel("commentary").with_recipient("functions.get_weather")])
    found = get_tool_parser("openai")().extract(bad)
    assert found.tool_calls == [] and "{not json" in found.content


def test_harmony_parsers_are_checked_at_start_up(monkeypatch):
    """`--reasoning-parser openai_gptoss` / `--tool-call-parser openai` start only where
    openai-harmony loads its vocabulary; elsewhere start-up fails naming the flag."""
    import jaxllm.entrypoints.harmony as harmony
    from serving import cli_args
    from serving.cli.serve import parse_args

    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "openai",
             "--reasoning-parser", "openai_gptoss"]
    settings = cli_args.chat_output_settings(parse_args(flags))
    assert settings["tool_call_parser"] == "openai"

    def unavailable():
        raise harmony.HarmonyUnavailable("no vocabulary here")

    monkeypatch.setattr(harmony, "encoding", unavailable)
    with pytest.raises(ValueError, match="--tool-call-parser openai: no vocabulary here"):
        cli_args.chat_output_settings(parse_args(flags))


def test_constraint_starts_at_the_final_message():
    """`openai_gptoss`'s grammar gate (structured output after the reasoning, as vLLM): the
    model is inside its analysis from the first token, and the constraint starts after the
    final channel's header, which a reply's tokens contain exactly where the answer begins;
    a prompt that opened the final message itself gets no gate."""
    import openai_harmony as h
    from types import SimpleNamespace

    from jaxllm.entrypoints.openai_parsers.reasoning_parsers import get_reasoning_parser

    enc = encoding()
    tok = SimpleNamespace(encode=lambda text, add_special_tokens=False:
                          enc.encode(text, allowed_special="all"))
    prompt = render_prompt([{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    gate = get_reasoning_parser("openai_gptoss")(tok).grammar_gate(prompt)
    assert gate is not None and gate.inside and len(gate.close) == 3
    reply = _reply_tokens(prompt, [
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Think.").with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, '{"a": 1}').with_channel("final")])
    at = next(i for i in range(len(reply)) if tuple(reply[i:i + 3]) == gate.close)
    assert enc.decode(reply[at + 3:]).startswith('{"a": 1}')
    assert enc.decode(reply[:at]).count("Think.") == 1
    opened = prompt + list(gate.close)
    assert get_reasoning_parser("openai_gptoss")(tok).grammar_gate(opened) is None
