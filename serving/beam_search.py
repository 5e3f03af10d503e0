"""`use_beam_search` on /v1/completions: vLLM's frontend beam search over the async engine.

Each step is one engine request per live beam (admitted and aborted like any other, through
`submit`); `n` is the beam width and the n best sequences are the choices, best first. Fields
beam search does not apply (streaming, logprobs, echo, stop strings, seeds) are refused by name.
"""

from __future__ import annotations

from jaxllm.entrypoints.beam_search import BeamSearch, BeamSearchParams
from serving.errors import APIError
from serving.generation import Prompt, collect, max_tokens_for, submit
from serving.protocol import STRUCTURED_FIELDS, UsageInfo
from serving.protocol_completion import (CompletionRequest, CompletionResponse,
                                         CompletionResponseChoice)
from serving.state import ServingState

_NOT_WITH_BEAM_SEARCH = ("stream", "logprobs", "echo", "stop", "stop_token_ids", "seed",
                         "prompt_logprobs", "logit_bias", "min_tokens", "allowed_token_ids",
                         "bad_words")
# Sampling fields beam search does not apply: accepted only at their no-op values.
_NEUTRAL_WITH_BEAM_SEARCH = {"top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0),
                             "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
                             "repetition_penalty": (None, 1.0)}


def check_beam_request(req: CompletionRequest, max_tokens: int) -> BeamSearchParams:
    for name in _NOT_WITH_BEAM_SEARCH:
        if getattr(req, name) not in (None, False, 0, []):
            raise APIError(f"{name} is not supported with use_beam_search.", param=name)
    for name, neutral in _NEUTRAL_WITH_BEAM_SEARCH.items():
        if getattr(req, name) not in neutral:
            raise APIError(f"{name} is not supported with use_beam_search.", param=name)
    if req.structured_output_params() is not None:
        name = next(n for n in STRUCTURED_FIELDS if getattr(req, n))
        raise APIError(f"{name} (structured output) is not supported with use_beam_search.",
                       param=name)
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens,
                                ignore_eos=req.ignore_eos,
                                temperature=req.temperature or 0.0,
                                length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as e:
        raise APIError(str(e), param="max_tokens" if "max_tokens" in str(e) else "n") from None


async def beam_search_completion(state: ServingState, req: CompletionRequest, model: str,
                                 prompts: list[Prompt], request_id: str) -> CompletionResponse:
    params = check_beam_request(req, min(max_tokens_for(state, len(p.token_ids), req.max_tokens)
                                         for p in prompts))
    try:
        search = BeamSearch([p.token_ids for p in prompts], params, state.engine.eos_token_ids,
                            state.max_model_len, state.max_logprobs)
    except ValueError as e:
        raise APIError(str(e), param="n") from None
    step = 0
    while not search.done:
        pending = search.pending()
        streams = await submit(state, [Prompt(ids, None) for ids in pending],
                               [search.sampling_params] * len(pending),
                               f"{request_id}-beam{step}", req.priority,
                               state.lora_request(model))
        search.advance([out.outputs[0].logprobs[0] for out in await collect(streams)])
        step += 1
    choices, generated = [], 0
    for i, (p, out) in enumerate(zip(prompts, search.outputs(state.tokenizer))):
        for j, seq in enumerate(out.sequences):
            generated += len(seq.tokens) - len(p.token_ids)
            choices.append(CompletionResponseChoice(
                index=i * req.n + j, text=seq.text or "", finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason))
    usage = UsageInfo.of(sum(len(p.token_ids) for p in prompts), generated)
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
