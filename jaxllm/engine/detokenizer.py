"""Token ids -> streamed text deltas, with stop strings, as vLLM's incremental detokenizer.

Each new token is decoded within a short window of ids (vLLM's prefix/read offsets): the text of
ids[prefix:] minus the text of ids[prefix:read] is the new text, so leading spaces and merges come
out as in a full decode, and a window whose text ends in U+FFFD (a UTF-8 character split across
tokens) is held until the character completes. Stop strings are searched in the text, across
token boundaries; text that could still become a stop string is held back from the delta until
it either completes (the output ends before it) or stops matching (the text is released).

With a fast (Rust-backed) tokenizer, as vLLM's FastIncrementalDetokenizer, a token is one step of
tokenizers' DecodeStream, primed with the same prompt ids: one native call, where the window
takes two decodes through transformers per token, host time paid on every decode step
(docs/performance.md, "The decode step's host work and sampler").
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import tokenizers
from tokenizers.decoders import DecodeStream

logger = logging.getLogger("jaxllm")

_PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token (vLLM uses 5)


class IncrementalDetokenizer:
    """One sequence's output text. `text` is everything decoded so far (cut at a stop string);
    the deltas returned by `add_tokens` and `flush` concatenate to it, and `released_text` is
    their concatenation so far."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: list[str] = (),
                 include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self._tokenizer = tokenizer
        self._decode_kwargs = dict(skip_special_tokens=skip_special_tokens,
                                   spaces_between_special_tokens=spaces_between_special_tokens)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT - 2:])
        self._read = len(self._ids)
        self._prefix = max(self._read - _PROMPT_CONTEXT, 0)
        self._stop = list(stop)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._num_output = 0
        self._emitted = 0
        self.text = ""
        self._stream = _decode_stream(tokenizer, self._ids, skip_special_tokens,
                                      spaces_between_special_tokens)

    def add_tokens(self, new_ids: list[int], *, stop_terminated: bool = False
                   ) -> tuple[str, Optional[str]]:
        """Decode new_ids -> (delta text, the stop string that ended the output or None).
        stop_terminated: the last id is the eos/stop token that ended the request, so its text
        is left out (unless include_stop_str_in_output) and nothing is held back."""
        ids = list(new_ids)
        if stop_terminated and not self._include_stop and ids:
            ids.pop()
            self._num_output += 1
        check_from = len(self.text)
        for token_id in ids:
            self.text += self._decode_next(token_id)
            self._num_output += 1
            if self._num_output <= self._min_tokens:
                check_from = len(self.text)  # vLLM: no stop strings within min_tokens
        found = None
        if self._stop and self._num_output > self._min_tokens:
            found = _find_stop(self.text, check_from, self._stop, self._include_stop)
            if found:
                self.text = self.text[:found[1]]
        if found or stop_terminated or self._include_stop:
            return self.flush(), found and found[0]
        release = len(self.text) - _partial_stop_len(self.text, self._stop)
        delta = self.text[self._emitted:release]
        self._emitted = max(self._emitted, release)
        return delta, None

    @property
    def streams(self) -> bool:
        """Which path decodes: True, tokenizers' DecodeStream (one native call a token); False,
        the decoded window (a slow tokenizer, or options the stream cannot honour)."""
        return self._stream is not None

    @property
    def released_text(self) -> str:
        """The text given out so far: `text` minus what is held back (for cumulative streams)."""
        return self.text[:self._emitted]

    def flush(self) -> str:
        """The text still held back; call when the request ends without a stop string."""
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta

    def _decode_next(self, token_id: int) -> str:
        if self._stream is not None:
            return self._step(token_id) or ""
        self._ids.append(token_id)
        decode = functools.partial(self._tokenizer.decode, **self._decode_kwargs)
        prefix_text = decode(self._ids[self._prefix:self._read])
        new_text = decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        del self._ids[:self._read]  # the next window starts at the old read offset
        self._prefix, self._read = 0, len(self._ids)
        return new_text[len(prefix_text):]

    def _step(self, token_id: int) -> Optional[str]:
        stream, backend = self._stream
        try:
            return stream.step(backend, token_id)
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            if not str(e).startswith("Invalid prefix"):
                raise
            # A tokenizer whose text of ids is not a prefix of that of more ids breaks the
            # stream's state (vLLM issue 17448): start a new one from this token.
            logger.warning("detokenizer: %s; the decode stream restarts at token %d", e,
                           token_id)
            stream = DecodeStream(skip_special_tokens=self._decode_kwargs["skip_special_tokens"])
            self._stream = (stream, backend)
            return stream.step(backend, token_id)


def _decode_stream(tokenizer, context: list[int], skip_special_tokens: bool,
                   spaces_between_special_tokens: bool):
    """(DecodeStream primed with context, the Rust tokenizer), or None where the stream would
    not give tokenizer.decode's text: a slow tokenizer, decode-time clean-up of spaces, or
    special tokens kept without spaces between them."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (not isinstance(backend, tokenizers.Tokenizer)
            or getattr(tokenizer, "clean_up_tokenization_spaces", False)
            or not (skip_special_tokens or spaces_between_special_tokens)):
        return None
    try:
        return DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens), backend
    except TypeError:  # a tokenizers release whose DecodeStream cannot be primed with ids
        return None


def _find_stop(text: str, check_from: int, stop: list[str], include: bool):
    """The earliest stop string ending after check_from -> (it, where text ends), or None.
    (vLLM takes the first one in list order; earliest in the text is what a reader expects.)"""
    best = None
    for s in stop:
        i = text.find(s, max(0, check_from - len(s) + 1))
        if i != -1 and (best is None or i < best[1]):
            best = (s, i)
    if best is None:
        return None
    s, i = best
    return s, i + len(s) if include else i


def _partial_stop_len(text: str, stop: list[str]) -> int:
    """Length of the longest end of text that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


@functools.lru_cache(maxsize=1 << 18)
def decode_logprob_token(tokenizer, token_id: int) -> str:
    """`Logprob.decoded_token`: the token decoded alone, special tokens kept, as vLLM does
    (a piece of a UTF-8 character comes out as U+FFFD). Cached: logprobs ask for many per step."""
    return tokenizer.decode([token_id])
