"""Structured output in the engine: a request's constraint compiled once (cached per schema)
into a matcher per sequence, and each sampled token fed back to it on the host.

The mask itself is written by the sampler's host packing (jaxllm/sequence.py) into the
banned-token bitmask that the jitted sampler applies, so a grammar row costs one
bitmask row per step and needs no program of its own. The matcher must have seen every token
before the next mask is built, so steps with a grammar row are read before the next one is
scheduled (no async overlap, no multi-step bursts for them; see engine.py).

Compiling is done on the engine thread: the tokenizer's token trie is built once per engine
(on the first constrained request), and a new schema compiles in less than one decode step of a
batch (cached after that; docs/performance.md, 'Structured output, MoE and multi-host'), so a
thread hand-off would cost more than it saves.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

from jaxllm.sequence import Sequence, SequenceStatus
from jaxllm.structured_output.backend import CompiledGrammar, get_compiler
from jaxllm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("jaxllm")


class Grammars:
    """The engine's grammar compiler for its tokenizer, built on first use. `config` is
    --structured-outputs-config: its disable_any_whitespace / disable_additional_properties
    apply to every request (as vLLM's StructuredOutputsConfig)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, config: Optional[dict] = None):
        self._defaults = {k: True for k in ("disable_any_whitespace",
                                            "disable_additional_properties")
                          if (config or {}).get(k)}
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = tuple(sorted(eos_token_ids))
        self.compile_seconds: list[float] = []  # per compile that missed the cache

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint; a GrammarError (a ValueError naming the problem) if the
        schema, regex or grammar cannot be compiled."""
        if self._tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer (skip_tokenizer_init is set)")
        if self._defaults:
            params = dataclasses.replace(params, **self._defaults)
        t = time.perf_counter()
        compiler = get_compiler(self._tokenizer, self._vocab_size, self._eos)
        misses = compiler.num_compiles
        compiled = compiler.compile(params)
        if compiler.num_compiles != misses:
            self.compile_seconds.append(time.perf_counter() - t)
            logger.debug("compiled a %s grammar in %.1f ms", params.kind,
                         1e3 * self.compile_seconds[-1])
        return compiled


def advance(seq: Sequence, token: int) -> Optional[tuple[SequenceStatus, Optional[str]]]:
    """Feed a sampled token to the sequence's matcher. Returns how the sequence ends, if the
    grammar ends it: complete -> (FINISHED_STOPPED, None); dead end (the token was not
    allowed, or nothing is) -> (FINISHED_ERROR, the matcher's error)."""
    m = seq.grammar
    if m is None or seq.is_finished:  # ended already (EOS, stop, length): no next mask
        return None
    if not m.accept(token) or m.is_error():
        return SequenceStatus.FINISHED_ERROR, f"grammar dead end: {m.error or token}"
    if m.is_terminated():
        return SequenceStatus.FINISHED_STOPPED, None
    return None
