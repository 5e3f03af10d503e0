"""Prompts in every shape OpenAI allows, turned into checked token ids before the engine sees them.

Checking here (not only in the engine) lets the server give vLLM's messages, with both numbers,
and pick the default max_tokens, which depends on the prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from serving.errors import APIError
from serving.state import ServingState


@dataclass
class Prompt:
    token_ids: list[int]
    text: Optional[str]  # None for token-id prompts until decoded (only echo needs it)


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
