"""POST /tokenize and /detokenize (vLLM's extensions), with the server's own tokenizer."""

from __future__ import annotations

from serving.errors import APIError
from serving.generation import Prompt, chat_prompt
from serving.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                              TokenizeResponse)
from serving.state import ServingState


async def tokenize(state: ServingState, req: TokenizeRequest) -> TokenizeResponse:
    state.model_name(req.model)
    if req.messages is not None:
        if req.add_generation_prompt and req.continue_final_message:
            raise APIError("Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to true.", param="continue_final_message")
        prompt, _ = await chat_prompt(state, req, req.tools)
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        prompt = Prompt(await state.encode(req.prompt, add_special), req.prompt)
    tokens = prompt.token_ids
    strs = state.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens,
                            token_strs=strs)


async def detokenize(state: ServingState, req: DetokenizeRequest) -> DetokenizeResponse:
    state.model_name(req.model)
    bad = [t for t in req.tokens if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(f"Token id {bad[0]} is out of vocabulary (size {state.vocab_size}).",
                       param="tokens")
    text = await state.in_tokenizer_thread(state.require_tokenizer().decode, req.tokens)
    return DetokenizeResponse(prompt=text)
