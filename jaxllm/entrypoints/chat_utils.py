"""OpenAI chat messages -> one prompt string, through the tokenizer's Jinja chat template.

Shared by the server and `LLM.chat`, so both render a conversation identically. Errors are
ValueErrors whose message the server can return to the client as a 400.

A template that never reads `tools` (SmolLM2's) drops them without a word, and tool_choice
"auto" then cannot call what the model never saw. So the first time a template is given tools
it is rendered again without them: the same prompt both ways is a warning naming the template,
logged once per template and process.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from functools import partial
from typing import Any, Iterable, Optional

logger = logging.getLogger("jaxllm")

TEXT_PART_TYPES = ("text", "input_text")
# Image parts a vision-language model takes: an image_url ({"url": ...}), a PIL image
# ("image_pil", as vLLM's LLM.chat), or "image" holding either.
IMAGE_PART_TYPES = ("image_url", "image_pil", "image")
# Parts refused by name until their modality is built.
_UNBUILT_PARTS = {"input_audio": "audio", "audio_url": "audio", "video_url": "video",
                  "image_embeds": "image embeddings"}
# Arguments apply_chat_template takes from us; chat_template_kwargs may not override them.
_RESERVED_KWARGS = {"conversation", "messages", "tools", "documents", "chat_template",
                    "add_generation_prompt", "continue_final_message", "tokenize", "return_dict"}


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """--chat-template takes a file path or the Jinja template itself, as in vLLM."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")


# A template that loops over a message's content wants OpenAI's list of parts (vLLM's "auto").
_LOOPS_OVER_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]"
                                 r"|\.content)")


def content_format_of(template: Optional[str], content_format: str = "auto") -> str:
    """'string' or 'openai': `content_format` itself, or for 'auto' what `template` expects."""
    if content_format not in ("auto", "string", "openai"):
        raise ValueError(f"chat_template_content_format must be auto, string or openai, got "
                         f"{content_format!r}")
    if content_format != "auto":
        return content_format
    return "openai" if template and _LOOPS_OVER_CONTENT.search(template) else "string"


def normalize_messages(messages: Iterable[Any], content_format: str = "string",
                       images: Optional[list] = None, image_placeholder: str = "") -> list[dict]:
    """Plain dicts for the template. Content becomes a string (text parts joined, newline
    separated: vLLM's 'string' format) or, for 'openai', a list of text parts. Image and audio
    parts are refused, since no model here takes them. Assistant tool calls get their
    `arguments` JSON text as an object, which is what chat templates iterate over (as vLLM).
    images: a vision-language model's list, which gets each image part's image or URL in
    order; the part stays an {"type": "image"} part ('openai') or becomes
    `image_placeholder` in the text ('string')."""
    out = []
    for i, message in enumerate(messages):
        if hasattr(message, "model_dump"):
            message = message.model_dump(exclude_none=True)
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        message = dict(message)
        parts = _content_parts(message.get("content"), i, images)
        if content_format == "openai" and any(p["type"] == "image" for p in parts):
            message["content"] = parts
        else:
            text = "\n".join(p.get("text", image_placeholder) for p in parts)
            message["content"] = ([{"type": "text", "text": text}]
                                  if content_format == "openai" else text)
        if message.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(message["tool_calls"], i)
        out.append(message)
    if not out:
        raise ValueError("messages must not be empty")
    return out


def _tool_calls(calls: Any, i: int) -> list[dict]:
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"messages[{i}].tool_calls[{j}] needs a function with a string "
                             f"'name'")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                                 f"valid JSON") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _content_parts(content: Any, i: int, images: Optional[list]) -> list[dict]:
    """A message's content as text and image parts (images appended to `images`)."""
    if content is None:
        return [{"type": "text", "text": ""}]
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of content parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _UNBUILT_PARTS:
            raise ValueError(f"messages[{i}].content: {kind!r} parts are not supported "
                             f"({_UNBUILT_PARTS[kind]} input is not implemented)")
        if kind in IMAGE_PART_TYPES and images is not None:
            images.append(_image_ref(part, kind, i))
            parts.append({"type": "image"})
            continue
        if kind not in TEXT_PART_TYPES:
            raise ValueError(f"messages[{i}].content: part type {kind!r} is not supported "
                             + ("(text only: this model takes no images)"
                                if kind in IMAGE_PART_TYPES else "(text and images only)"))
        if not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}].content: a text part needs a string 'text'")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _image_ref(part: dict, kind: str, i: int) -> Any:
    """An image part's PIL image or URL string (jaxllm/entrypoints/media.py reads it)."""
    value = part.get(kind)
    if kind == "image_url":
        value = value.get("url") if isinstance(value, dict) else value
    if value is None:
        raise ValueError(f"messages[{i}].content: an {kind!r} part needs its {kind!r} value")
    return value


def render_chat_prompt(tokenizer, messages: Iterable[Any], *,
                        chat_template: Optional[str] = None,
                        add_generation_prompt: bool = True,
                        continue_final_message: bool = False,
                        tools: Optional[list[dict]] = None,
                        chat_template_kwargs: Optional[dict] = None,
                        content_format: str = "auto",
                        template_source: Optional[str] = None,
                        images: Optional[list] = None, image_placeholder: str = "") -> str:
    """The prompt text for `messages`; tokenize it without adding special tokens again.
    `content_format` is vLLM's --chat-template-content-format (auto, string or openai).
    `template_source` names the template in the warning about dropped tools (say, "the chat
    template of MODEL" or "--chat-template")."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer (this engine was started with "
                         "skip_tokenizer_init)")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("The tokenizer has no chat template; pass one with --chat-template "
                         "(a file or a Jinja string).")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    kwargs = dict(chat_template_kwargs or {})
    clash = sorted(_RESERVED_KWARGS & set(kwargs))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
    template = chat_template or tokenizer.chat_template
    conversation = normalize_messages(messages, content_format_of(
        template if isinstance(template, str) else None, content_format), images,
        image_placeholder)
    render = partial(tokenizer.apply_chat_template, conversation, chat_template=chat_template,
                     add_generation_prompt=add_generation_prompt,
                     continue_final_message=continue_final_message, tokenize=False, **kwargs)
    try:
        text = render(tools=tools)
    except Exception as e:  # whatever a (sandboxed) template raises is the template's fault,
        # or its input's: ZeroDivisionError, OverflowError (range(10**9)), a timeout...
        raise ValueError(f"chat template error: {str(e) or type(e).__name__}") from None
    if tools and _first_render_with_tools(template):
        _warn_if_tools_dropped(render, text, len(tools), template_source or (
            "the given chat template" if chat_template else
            f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}"))
    return text


_TEMPLATES_WITH_TOOLS: set[int] = set()  # hashes of the templates checked for dropped tools
_TEMPLATES_LOCK = threading.Lock()


def _first_render_with_tools(template: Any) -> bool:
    """True once per template (a string, or a tokenizer's dict of named templates)."""
    key = hash(template if isinstance(template, str) else repr(template))
    with _TEMPLATES_LOCK:
        if key in _TEMPLATES_WITH_TOOLS:
            return False
        _TEMPLATES_WITH_TOOLS.add(key)
        return True


def _warn_if_tools_dropped(render, text: str, num_tools: int, source: str) -> None:
    """`text` (rendered with the tools) against a render without them."""
    try:
        dropped = render(tools=None) == text
    except Exception:  # a template that fails without tools does read them
        return
    if dropped:
        logger.warning(
            "%s does not render `tools`: the %d tool(s) of this request are not in the prompt, "
            "so the model does not see them and tool_choice \"auto\" will not call them. Pass "
            "--chat-template with a template that renders tools, or use tool_choice "
            "\"required\" or a named function (which constrain the output to a call). Logged "
            "once per template.", source[:1].upper() + source[1:], num_tools)
