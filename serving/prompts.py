"""Prompts in every shape OpenAI allows, turned into checked token ids before the engine sees them:
a text, token ids, lists of either (/v1/completions), and a chat conversation rendered with its
template (/v1/chat/completions, /tokenize).

Checking here (not only in the engine) lets the server give vLLM's messages, with both numbers,
and pick the default max_tokens, which depends on the prompt length.

Chat templates render under a time budget. Jinja compiles a template to Python code (its frames'
file name is "<template>"), so a trace function on the rendering thread can stop a template that
loops too long: nested `{% for %}` loops would otherwise hold the tokenizer thread, and every
text request behind it, for as long as they like. Only template frames are traced line by line;
other calls cost one check each. What one operation does is beyond its reach:
`{{ 'a' * 10**10 }}` allocates before any line ends, which is why request-supplied templates need
--trust-request-chat-template.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, TypeVar, Union

from jaxllm.entrypoints.chat_utils import normalize_messages, render_chat_prompt
from jaxllm.entrypoints.media import load_image
from serving.errors import APIError
from serving.state import ServingState

T = TypeVar("T")
TEMPLATE_FILE = "<template>"


@dataclass
class Prompt:
    token_ids: list[int]
    text: Optional[str]  # None for token-id prompts until decoded (only echo needs it)
    # With images: what the engine gets (the ids with one placeholder per image, and the
    # images); token_ids are then the expanded ids, as the engine will count them.
    engine_prompt: Optional[dict] = None


def split_prompts(prompt: Union[str, list[str], list[int], list[list[int]]]) -> list:
    """'a' -> ['a']; [1, 2] -> [[1, 2]]; lists of either stay lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt cannot be empty.", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def to_prompts(state: ServingState, prompt, add_special_tokens: bool) -> list[Prompt]:
    out = []
    for p in split_prompts(prompt):
        if isinstance(p, str):
            out.append(Prompt(await state.encode(p, add_special_tokens), p))
        else:
            out.append(Prompt(list(p), None))
        check_token_ids(state, out[-1].token_ids)
    return out


def check_token_ids(state: ServingState, token_ids: list[int]) -> None:
    if not token_ids:
        raise APIError("prompt cannot be empty.", param="prompt")
    bad = [t for t in token_ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(f"Token id {bad[0]} is out of vocabulary (size {state.vocab_size}).",
                       param="prompt")


def truncated(state: ServingState, prompt: Prompt, keep: Optional[int]) -> Prompt:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: max_model_len); a cut
    prompt's text is dropped (echo decodes the tokens kept)."""
    if keep is None:
        return prompt
    if keep > state.max_model_len:
        raise APIError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                       f"({state.max_model_len}). Please select a smaller truncation size.",
                       param="truncate_prompt_tokens")
    keep = state.max_model_len if keep == -1 else keep
    if prompt.engine_prompt is not None:
        raise APIError("truncate_prompt_tokens is not supported with images (it could cut an "
                       "image's tokens)", param="truncate_prompt_tokens")
    if len(prompt.token_ids) <= keep:
        return prompt
    return Prompt(prompt.token_ids[-keep:], None)


def max_tokens_for(state: ServingState, num_prompt_tokens: int, requested: Optional[int]) -> int:
    """vLLM's rule: the request's max_tokens if it fits; if unset, the rest of the context
    (capped by the generation config's max_new_tokens)."""
    limit = state.max_model_len
    if num_prompt_tokens >= limit:
        raise APIError(f"This model's maximum context length is {limit} tokens. However, your "
                       f"request has {num_prompt_tokens} input tokens. Please reduce the length "
                       f"of the input.", param="prompt")
    if requested is None:
        cap = state.generation_defaults.get("max_new_tokens")
        return min(limit - num_prompt_tokens, cap or limit)
    if requested >= 1 and num_prompt_tokens + requested > limit:
        raise APIError(f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This "
                       f"model's maximum context length is {limit} tokens and your request has "
                       f"{num_prompt_tokens} input tokens ({requested} > {limit} - "
                       f"{num_prompt_tokens}).", param="max_tokens")
    return requested


# --- chat conversations ---------------------------------------------------------------------------

async def chat_prompt(state: ServingState, req, tools: Optional[list] = None
                      ) -> tuple[Prompt, list[dict]]:
    """The conversation as prompt tokens, and the normalized messages.

    A request's own `chat_template` is used (as a Jinja string, never a file path) only when
    the operator trusts them (--trust-request-chat-template, as vLLM). Rendering runs on the
    tokenizer thread within --chat-template-timeout; a template that fails or overruns is a
    400. `tools` are rendered into the prompt by the template's `tools` argument."""
    tokenizer = state.require_tokenizer()
    limits = state.limits
    if req.chat_template is not None and not limits.trust_request_chat_template:
        raise APIError("Chat template is passed with request, but --trust-request-chat-template "
                       "is not set. Refused request with untrusted chat template.",
                       param="chat_template")
    images = [] if state.images is not None else None  # a vision-language model's parts
    try:
        messages = normalize_messages(req.messages, images=None if images is None else [])
        # with images, the request's own parts (the normalized messages have none left)
        render = partial(render_chat_prompt, tokenizer,
                         messages if images is None else req.messages,
                         chat_template=req.chat_template or state.chat_template,
                         add_generation_prompt=req.add_generation_prompt,
                         continue_final_message=req.continue_final_message, tools=tools,
                         chat_template_kwargs=req.chat_template_kwargs,
                         content_format=state.chat_template_content_format,
                         template_source=_template_source(state, req), images=images,
                         image_placeholder=state.images.placeholder if images is not None
                         else "")
        text = await state.in_tokenizer_thread(call_with_deadline, render,
                                               limits.chat_template_timeout)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    add_special = bool(req.add_special_tokens)
    prompt = Prompt(await state.encode(text, add_special), text)
    if images:  # read and preprocessed off the event loop and the tokenizer thread
        prompt = await asyncio.to_thread(_with_images, state, prompt, images)
    check_token_ids(state, prompt.token_ids)
    return prompt, messages


def _with_images(state: ServingState, prompt: Prompt, refs: list) -> Prompt:
    """The prompt with its images read (jaxllm/entrypoints/media.py), counted against
    --limit-mm-per-prompt and preprocessed: the engine's expansion of it, which the engine
    repeats from the processor's cache."""
    limit = state.images.max_images
    if limit is not None and len(refs) > limit:
        raise APIError(f"{len(refs)} images in one request; at most {limit} are allowed "
                       f"(--limit-mm-per-prompt)", param="messages")
    try:
        images = [load_image(r, state.media, where=f"image {i}") for i, r in enumerate(refs)]
        ids, _ = state.images.expand(prompt.token_ids, images)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    return Prompt(ids, prompt.text, {"prompt_token_ids": prompt.token_ids,
                                     "multi_modal_data": {"image": images}})


def _template_source(state: ServingState, req) -> str:
    """Which template renders `req`, for the log (the warning about dropped tools)."""
    if req.chat_template is not None:
        return "the request's chat_template"
    if state.chat_template is not None:
        return "the --chat-template template"
    return f"the chat template of model {state.model_path}"


class RenderTimeout(Exception):
    """A chat template ran past its time budget."""


def call_with_deadline(fn: Callable[[], T], seconds: float) -> T:
    """fn() on this thread, raising RenderTimeout once template code runs past `seconds`."""
    deadline = time.monotonic() + seconds

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise RenderTimeout(f"the chat template took longer than {seconds:g} s to render")
        return on_line

    def on_call(frame, event, arg):
        if frame.f_code.co_filename == TEMPLATE_FILE:
            return on_line(frame, event, arg)
        return None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return fn()
    finally:
        sys.settrace(previous)
