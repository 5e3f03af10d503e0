"""GPT-OSS's harmony format through OpenAI's `openai-harmony` package: OpenAI chat messages
(with `reasoning` and `tool_calls`, and tool results) rendered to prompt token ids, and the
model's output tokens parsed back into reasoning (the `analysis` channel), content (`final`,
and `commentary` without a recipient) and function calls (`commentary` to `functions.NAME`),
whole or streamed token by token. The format's rules (which channels exist, dropping earlier
turns' analysis, the special tokens) are the package's; this module maps OpenAI's message
shapes onto it, as vLLM's harmony utilities do.

openai-harmony needs the o200k_base vocabulary, which it downloads unless
TIKTOKEN_ENCODINGS_BASE names a folder holding it. Offline, `encoding()` takes the copy the
`bpe-openai` package ships (gzipped) when that is installed, checked against tiktoken's
published SHA-256 before use. The server's `openai_gptoss` reasoning parser and `openai` tool
parser read outputs through `read_text` (the text with the special tokens kept, tokenized
again); its prompts come from the model's chat template (GPT-OSS tokenizers ship harmony's).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import os
import tempfile
from typing import Any, Iterable, Optional

O200K_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # tiktoken's
ENV = "TIKTOKEN_ENCODINGS_BASE"


class HarmonyUnavailable(RuntimeError):
    """openai-harmony, or the o200k_base vocabulary it needs, is not available here."""


def _offline_vocabulary() -> Optional[str]:
    """A folder holding o200k_base.tiktoken from the bpe-openai package (None without it)."""
    # Found, not imported: importing bpe_openai reads all of its vocabularies.
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        return None
    packed = os.path.join(spec.submodule_search_locations[0], "data", O200K_FILE + ".gz")
    if not os.path.exists(packed):
        return None
    with gzip.open(packed, "rb") as f:
        raw = f.read()
    if hashlib.sha256(raw).hexdigest() != O200K_SHA256:
        raise HarmonyUnavailable(f"{packed} is not tiktoken's o200k_base (SHA-256 differs)")
    folder = os.path.join(tempfile.gettempdir(), "jaxllm-o200k")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, O200K_FILE)
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    return folder


@functools.lru_cache(maxsize=1)
def encoding():
    """The HARMONY_GPT_OSS encoding (raises HarmonyUnavailable, saying why, where it cannot
    be loaded)."""
    try:
        import openai_harmony as h
    except ImportError as e:
        raise HarmonyUnavailable("the harmony format needs the openai-harmony package "
                                 "(pip install 'jaxllm[harmony]')") from e
    if not os.environ.get(ENV):
        folder = _offline_vocabulary()
        if folder is not None:
            os.environ[ENV] = folder
    try:
        return h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
    except h.HarmonyError as e:
        raise HarmonyUnavailable(f"openai-harmony could not load the o200k_base vocabulary "
                                 f"({e}); set {ENV} to a folder holding {O200K_FILE}, or "
                                 "install bpe-openai, which ships it") from e


def _text(content: Any) -> str:
    """An OpenAI message content (a string or a list of text parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type", "text") == "text")


def to_harmony(messages: list[dict], tools: Optional[list[dict]] = None,
               reasoning_effort: Optional[str] = None) -> list:
    """OpenAI chat messages (and function tools) -> harmony Messages: a harmony system message
    (its reasoning effort), a developer message with the request's system/developer text as
    instructions and the tools; assistants' `reasoning` on the analysis channel, their content
    on final, each tool call on commentary to functions.NAME as JSON; tool results from
    functions.NAME (named by their tool_call_id) on commentary."""
    import openai_harmony as h

    system = h.SystemContent.new()
    if reasoning_effort is not None:
        system = system.with_reasoning_effort(h.ReasoningEffort(reasoning_effort.capitalize()))
    out = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    instructions = "\n".join(_text(m.get("content")) for m in messages
                             if m["role"] in ("system", "developer"))
    if instructions or tools:
        developer = h.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools([
                h.ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                      parameters=t["function"].get("parameters"))
                for t in tools])
        out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
    names: dict[str, str] = {}  # tool_call_id -> function name
    for m in messages:
        role = m["role"]
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(h.Message.from_role_and_content(h.Role.USER, _text(m.get("content"))))
        elif role == "assistant":
            reasoning = m.get("reasoning") or m.get("reasoning_content")
            if reasoning:
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, reasoning)
                           .with_channel("analysis"))
            for call in m.get("tool_calls") or ():
                fn = call["function"]
                names[call.get("id", "")] = fn["name"]
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, fn["arguments"])
                           .with_channel("commentary").with_recipient(f"functions.{fn['name']}")
                           .with_content_type("json"))
            if _text(m.get("content")):
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT,
                                                           _text(m.get("content")))
                           .with_channel("final"))
        elif role == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id", ""))
            if name is None:
                raise ValueError(f"tool message with tool_call_id {m.get('tool_call_id')!r} "
                                 "answers no earlier tool call")
            out.append(h.Message.from_author_and_content(
                h.Author.new(h.Role.TOOL, f"functions.{name}"), _text(m.get("content")))
                .with_channel("commentary").with_recipient("assistant"))
        else:
            raise ValueError(f"message role {role!r} has no harmony form")
    return out


def render_prompt(messages: list[dict], tools: Optional[list[dict]] = None,
                  reasoning_effort: Optional[str] = None) -> list[int]:
    """The prompt token ids that ask the assistant for its next message."""
    import openai_harmony as h

    conversation = h.Conversation.from_messages(to_harmony(messages, tools, reasoning_effort))
    return list(encoding().render_conversation_for_completion(conversation, h.Role.ASSISTANT))


class HarmonyOutputParser:
    """One output's parser: feed its token ids (`feed`, any number at a time) and get OpenAI
    deltas {"reasoning", "content", "tool_calls"}; `whole` is the same for a finished output.
    Tool calls are numbered in order; each call's first delta carries its id, type and name,
    the rest its arguments."""

    def __init__(self, call_ids: Optional[Iterable[str]] = None):
        import openai_harmony as h

        self._parser = h.StreamableParser(encoding(), role=h.Role.ASSISTANT)
        self._ids = iter(call_ids) if call_ids is not None else None
        self._calls = -1
        self._open: Optional[tuple] = None  # the message being streamed: (channel, recipient)

    def _call_id(self) -> str:
        if self._ids is not None:
            return next(self._ids)
        return f"call_{os.urandom(12).hex()}"

    def feed(self, token_ids: Iterable[int]) -> Optional[dict]:
        """The delta for these new tokens (None: nothing to send yet)."""
        out: dict = {}
        for t in token_ids:
            self._parser.process(t)
            piece = self._parser.last_content_delta
            if not piece:
                continue
            channel, recipient = self._parser.current_channel, self._parser.current_recipient
            if recipient and recipient.startswith("functions."):
                calls = out.setdefault("tool_calls", [])
                if self._open != (channel, recipient, len(self._parser.messages)):
                    self._open = (channel, recipient, len(self._parser.messages))
                    self._calls += 1
                    calls.append({"index": self._calls, "id": self._call_id(),
                                  "type": "function",
                                  "function": {"name": recipient[len("functions."):],
                                               "arguments": ""}})
                if not calls or calls[-1]["index"] != self._calls:
                    calls.append({"index": self._calls, "function": {"arguments": ""}})
                calls[-1]["function"]["arguments"] += piece
            else:
                key = "reasoning" if channel == "analysis" else "content"
                out[key] = out.get(key, "") + piece
        return out or None

    def whole(self, token_ids: Iterable[int]) -> dict:
        """{"reasoning", "content", "tool_calls"} of a finished output (None for an empty
        text part)."""
        delta = self.feed(token_ids) or {}
        return {"reasoning": delta.get("reasoning") or None,
                "content": delta.get("content") or None,
                "tool_calls": delta.get("tool_calls", [])}


def read_text(text: str) -> tuple[str, list[tuple[Optional[str], str, bool]]]:
    """A (possibly partial) output as text with harmony's special tokens kept ->
    (reasoning: the analysis channel's text, and the other messages in order as
    (recipient, text, ended)). The text is tokenized again with the harmony encoding: its
    markers are whole special tokens, so this reads what the token ids would."""
    import openai_harmony as h

    enc = encoding()
    parser = h.StreamableParser(enc, role=h.Role.ASSISTANT)
    for t in enc.encode(text, allowed_special="all"):
        parser.process(t)
    reasoning, rest = "", []
    messages = [(m.channel, m.recipient, "".join(c.text for c in m.content), True)
                for m in parser.messages]
    if parser.current_content:
        messages.append((parser.current_channel, parser.current_recipient,
                         parser.current_content, False))
    for channel, recipient, body, ended in messages:
        if channel == "analysis":
            reasoning += body
        else:
            rest.append((recipient, body, ended))
    return reasoning, rest


def is_harmony_output(text: str) -> bool:
    """Whether an output (after the prompt's <|start|>assistant) is harmony: its first message
    header starts with the channel, or with the recipient."""
    return text.startswith(("<|channel|>", " to="))


def call_text(recipient: str, body: str, ended: bool) -> str:
    """A call message as harmony text (what `read_text` reads back as that message)."""
    return (f"<|start|>assistant to={recipient}<|channel|>commentary json<|message|>{body}"
            + ("<|call|>" if ended else ""))


def join_deltas(deltas: Iterable[Optional[dict]]) -> dict:
    """Streamed deltas joined into one message (`whole`'s shape): what a client does."""
    reasoning, content, calls = "", "", {}
    for d in deltas:
        if not d:
            continue
        reasoning += d.get("reasoning", "")
        content += d.get("content", "")
        for c in d.get("tool_calls", ()):
            call = calls.setdefault(c["index"], {"index": c["index"], "function":
                                                 {"arguments": ""}})
            for key in ("id", "type"):
                if key in c:
                    call[key] = c[key]
            if "name" in c["function"]:
                call["function"]["name"] = c["function"]["name"]
            call["function"]["arguments"] += c["function"].get("arguments", "")
    return {"reasoning": reasoning or None, "content": content or None,
            "tool_calls": [calls[i] for i in sorted(calls)]}


def tool_call_message(calls: list[dict]) -> dict:
    """An assistant message carrying `calls` (a parsed output's), as a client sends it back."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": c["id"], "type": "function",
                            "function": {"name": c["function"]["name"],
                                         "arguments": c["function"]["arguments"]}}
                           for c in calls]}


__all__ = ["HarmonyOutputParser", "HarmonyUnavailable", "call_text", "encoding",
           "is_harmony_output", "join_deltas", "read_text", "render_prompt", "to_harmony",
           "tool_call_message"]
