"""Engine logprobs ({token_id: Logprob} per position) in the two OpenAI response shapes."""

from __future__ import annotations

from typing import Optional

from jaxllm.outputs import LogprobDict
from serving.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                              ChatCompletionLogProbsContent)
from serving.protocol_completion import CompletionLogProbs
from serving.state import ServingState


def _ranked(position: LogprobDict) -> list:
    """Entries best first (by rank where the engine gave one, else by logprob)."""
    return sorted(position.items(), key=lambda kv: (kv[1].rank is None,
                                                    kv[1].rank or 0, -kv[1].logprob))


def _token(state: ServingState, token_id: int, decoded: Optional[str], as_ids: bool) -> str:
    """A token as logprobs show it: its text, or vLLM's "token_id:N" when the request sets
    return_tokens_as_token_ids (for tokens whose text is not valid UTF-8 alone)."""
    return f"token_id:{token_id}" if as_ids else state.token_str(token_id, decoded)


def completion_logprobs(state: ServingState, token_ids: list[int],
                        positions: list[Optional[LogprobDict]], text_offset: int = 0,
                        as_ids: bool = False) -> CompletionLogProbs:
    """Legacy shape: parallel lists; `top_logprobs` holds the chosen token and the top-k."""
    out = CompletionLogProbs()
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position else None
        token = _token(state, token_id, chosen.decoded_token if chosen else None, as_ids)
        out.tokens.append(token)
        out.text_offset.append(text_offset)
        text_offset += len(token)
        if position is None:  # the first prompt token has no logprob
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(chosen.logprob if chosen else None)
        top: dict[str, float] = {}
        for t, lp in _ranked(position):  # ids that decode alike ('\ufffd') keep the best
            top.setdefault(_token(state, t, lp.decoded_token, as_ids), lp.logprob)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(state: ServingState, token_ids: list[int], positions: list[LogprobDict],
                  top_logprobs: int, as_ids: bool = False) -> ChatCompletionLogProbs:
    """Chat shape: one entry per token, with UTF-8 bytes and the `top_logprobs` best."""
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id)
        token = _token(state, token_id, chosen.decoded_token if chosen else None, as_ids)
        top = [_entry(_token(state, t, lp.decoded_token, as_ids), lp.logprob)
               for t, lp in _ranked(position)[:top_logprobs]]
        content.append(ChatCompletionLogProbsContent(
            **_entry(token, chosen.logprob if chosen else -9999.0).model_dump(),
            top_logprobs=top))
    return ChatCompletionLogProbs(content=content)


def _entry(token: str, logprob: float) -> ChatCompletionLogProb:
    return ChatCompletionLogProb(token=token, logprob=max(logprob, -9999.0),
                                 bytes=list(token.encode("utf-8", errors="replace")))


def prompt_logprobs_json(positions) -> Optional[list]:
    """vLLM's `prompt_logprobs` field: per position {token_id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if p is None else
            {t: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in p.items()}
            for p in positions]
