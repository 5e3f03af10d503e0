"""From what a caller sends to what the engine runs: a prompt (text, token ids or a vLLM
prompt dict) and its parameters, checked once, with errors that name the field.

Tokenizing, truncation (truncate_prompt_tokens), vocabulary and length checks, the default
max_tokens (what the context leaves), the parameters checked against the model, the grammar
compiled, and each of the n sequences' seed. `LLM`, the server and the data-parallel engine
(which tokenizes once to route) all come through here.

Before that, a chat (OpenAI messages) becomes one prompt string through the tokenizer's Jinja
chat template (`render_chat_prompt`), shared by the server and `LLM.chat` so both render a
conversation identically; its errors are ValueErrors the server returns as a 400. A template
that never reads `tools` (SmolLM2's) drops them without a word, and tool_choice "auto" then
cannot call what the model never saw; so the first time a template is given tools it is
rendered again without them, and the same prompt both ways is a warning naming the template
(once per template and process).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable, Optional, Union

import numpy as np

from jaxllm.engine.grammar import Grammars
from jaxllm.engine.multimodal import image_processor, prompt_embeds_inputs
from jaxllm.lora.request import LoRARequest
from jaxllm.sampling_params import SamplingParams
from jaxllm.sequence import EXTRA_PENALTY_IDS, ImageInputs

PromptType = Union[str, list[int], dict]
# The keys of a prompt dict this engine reads (vLLM's TextPrompt / TokensPrompt / EmbedsPrompt).
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data", "prompt_embeds"})


@dataclass(frozen=True)
class EngineRequest:
    """A checked request, ready to fan out into its n sequences."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams  # the engine's own copy, max_tokens filled in
    seeds: tuple[int, ...]  # one per sequence
    eos_token_ids: frozenset
    grammar: Any = None     # a compiled grammar, its matcher made per sequence
    priority: int = 0
    arrival_time: float = 0.0
    lora_request: Optional[LoRARequest] = None
    mm: Optional[ImageInputs] = None  # the prompt's images (vision-language models)


class InputProcessor:
    @classmethod
    def from_config(cls, config, model_config, tokenizer, eos_token_ids: frozenset,
                    runner) -> "InputProcessor":
        """The engine's input processor: `config` the EngineConfig; `runner` says whether its
        backend can take images and how many tokens a step holds."""
        sc = config.scheduler
        return cls(tokenizer, model_config, max_logprobs=sc.max_logprobs,
                   eos_token_ids=eos_token_ids, structured_outputs=config.structured_outputs,
                   priority_scheduling=sc.policy == "priority", seed=config.model.seed,
                   images=image_processor(config, model_config, tokenizer,
                                          refusal=runner.image_refusal,
                                          max_step_tokens=runner.max_num_batched_tokens),
                   logits_processors=config.logits_processors)

    def __init__(self, tokenizer, model_config, *, max_logprobs: int, eos_token_ids: frozenset,
                 structured_outputs: Optional[dict] = None, priority_scheduling: bool = False,
                 seed: int = 0, images=None, logits_processors: tuple = ()):
        """structured_outputs: --structured-outputs-config (the grammar backend's defaults).
        images: a vision-language model's ImageProcessor (jaxllm/engine/multimodal.py).
        logits_processors: --logits-processors' classes, whose validate_params see each
        request's parameters."""
        self.images = images
        self.logits_processors = logits_processors
        self.prompt_embeds = model_config.prompt_embeds
        self.hidden_size = model_config.hidden_size
        self.architecture = model_config.architecture
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_model_len = model_config.max_model_len
        self.max_logprobs = max_logprobs
        self.eos_token_ids = eos_token_ids
        self.grammars = Grammars(tokenizer, model_config.vocab_size, eos_token_ids,
                                 structured_outputs)
        self.priority_scheduling = priority_scheduling
        self._rng = np.random.default_rng(seed)

    def process_prompt(self, prompt: PromptType, truncate_prompt_tokens: Optional[int] = None
                       ) -> tuple[Optional[str], list[int]]:
        """Text and token ids of a prompt given as text, token ids, or a vLLM prompt dict;
        truncate_prompt_tokens=k keeps its last k tokens (-1: max_model_len), as vLLM."""
        text, ids, _ = self._prompt(prompt, truncate_prompt_tokens)
        return text, ids

    def _prompt(self, prompt: PromptType, truncate_prompt_tokens: Optional[int]
                ) -> tuple[Optional[str], list[int], Optional[ImageInputs]]:
        text, ids, mm = None, None, None
        unknown = sorted(set(prompt) - PROMPT_KEYS) if isinstance(prompt, dict) else []
        if unknown:  # vLLM's other prompt keys (token_type_ids, cache_salt, ...) included
            raise ValueError(f"prompt key(s) {', '.join(map(str, unknown))} are not supported "
                             f"(supported: {', '.join(sorted(PROMPT_KEYS))})")
        if isinstance(prompt, dict) and prompt.get("prompt_embeds") is not None:
            return self._embeds_prompt(prompt, truncate_prompt_tokens)
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            text = prompt.get("prompt")
            if ids is None and text is None:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text = prompt
        else:
            ids = prompt
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set); "
                                 "pass prompt_token_ids")
            ids = self.tokenizer.encode(text)
        ids = [int(i) for i in ids]
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            if self.images is None:
                raise ValueError(f"multi_modal_data: this model ({self.architecture}) takes "
                                 "no images (a text-only architecture, or a multimodal "
                                 "checkpoint served text-only)")
            if truncate_prompt_tokens is not None:
                raise ValueError("truncate_prompt_tokens is not supported with images (it "
                                 "could cut an image's tokens)")
            ids, mm = self.images.expand(ids, self.images.images_of(prompt["multi_modal_data"]))
        limit = self.max_model_len
        keep = limit if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
            text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
        if not ids:
            raise ValueError("The prompt cannot be empty.")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (size {self.vocab_size}).")
        if len(ids) > limit:
            raise ValueError(f"The prompt (length {len(ids)}) is longer than the maximum model "
                             f"length of {limit}. Make it shorter, or raise --max-model-len.")
        return text, ids, mm

    def _embeds_prompt(self, prompt: dict, truncate_prompt_tokens: Optional[int]):
        if not self.prompt_embeds:
            raise ValueError("prompt_embeds: this engine was started without "
                             "--enable-prompt-embeds")
        other = sorted(k for k in ("prompt", "prompt_token_ids", "multi_modal_data")
                       if prompt.get(k) is not None)
        if other:
            raise ValueError(f"prompt_embeds cannot be combined with {', '.join(other)}")
        keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        ids, mm = prompt_embeds_inputs(prompt["prompt_embeds"], self.hidden_size, keep)
        if len(ids) > self.max_model_len:
            raise ValueError(f"The prompt (length {len(ids)}) is longer than the maximum model "
                             f"length of {self.max_model_len}. Make it shorter, or raise "
                             "--max-model-len.")
        return None, ids, mm

    def process(self, request_id: str, prompt: PromptType,
                params: Optional[SamplingParams] = None, priority: int = 0,
                arrival_time: Optional[float] = None,
                lora_request: Optional[LoRARequest] = None) -> EngineRequest:
        """lora_request: checked by the engine (its adapter registered) before this."""
        params = params.clone() if params is not None else SamplingParams()
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer (skip_tokenizer_init is set)")
            params.update_from_tokenizer(self.tokenizer)
        params.verify_for_model(self.vocab_size, self.max_logprobs)
        if params.extra_args and not self.logits_processors:
            raise ValueError("extra_args (vllm_xargs) are read by custom logits processors, "
                             "and this engine has none (--logits-processors)")
        for cls in self.logits_processors:
            cls.validate_params(params)
        grammar = (self.grammars.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        extra = len(params.logit_bias or {}) + len(params.stop_token_ids) + len(self.eos_token_ids)
        if extra > EXTRA_PENALTY_IDS:
            raise ValueError(f"logit_bias and stop_token_ids name {extra} tokens; at most "
                             f"{EXTRA_PENALTY_IDS} are supported.")
        text, ids, mm = self._prompt(prompt, params.truncate_prompt_tokens)
        if mm is not None and mm.given_embeds:  # what needs the prompt's token ids
            for name, on in (("repetition_penalty", params.repetition_penalty != 1.0),
                             ("prompt_logprobs", params.prompt_logprobs is not None)):
                if on:
                    raise ValueError(f"{name} is not supported with prompt_embeds (the "
                                     "prompt's token ids are unknown)")
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        if not self.priority_scheduling and priority != 0:
            raise ValueError("priority is only used with --scheduling-policy priority")
        seeds = tuple(params.seed + i if params.seed is not None
                      else int(self._rng.integers(2**31 - 1)) for i in range(params.n))
        return EngineRequest(request_id, text, ids, params, seeds, self.eos_token_ids, grammar,
                             priority, time.monotonic() if arrival_time is None else arrival_time,
                             lora_request, mm)


# Chat messages -> one prompt string (the module docstring says why tools are checked).

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
