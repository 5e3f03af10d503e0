"""The grammar engine: StructuredOutputsParams + tokenizer -> per-request matchers whose token
masks land in the sampler's banned-token bitmask.

Engine: llguidance (PyPI `llguidance`), chosen over xgrammar on a realistic nested JSON schema
(scripts/bench_grammar.py; figures in docs/performance.md, 'Figures moved out of code comments'):
  - dependencies: llguidance has none; xgrammar requires torch, transformers and triton - a
    torch requirement would pull a multi-GB CUDA build into a plain install;
  - grammar compile for a new schema, which that request waits for: milliseconds (llguidance)
    against seconds (xgrammar);
  - token mask per step: llguidance computes a batch's rows together on its thread pool,
    xgrammar one row after another, and took longer;
  - correctness: both mask JSON schema, regex, choice and EBNF (llguidance takes GBNF and Lark).
llguidance masks are lazy (computed per step from an Earley parser over a lexer), so the
per-schema work is building the first matcher (parsing the grammar, the lexer); the cache keeps
that matcher and each request copies it (a copy costs a tiny fraction of a build).

Layout: the sampler's `banned_bits` is uint32 [S, ceil(V/32)], bit i%32 of word i//32 set when
token i is banned; llguidance writes the same layout with the bit set when the token is allowed,
so `fill_banned_bits` writes into the rows in place and inverts them.
A matcher that has stopped (its grammar is complete and EOS was taken) or hit an error (a
token the mask did not allow) allows only EOS, so a request whose grammar dead-ends finishes
rather than hanging; the engine reads `is_error()` for the finish reason.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np

from jaxllm.structured_output.params import ReasoningGate, StructuredOutputsParams


class GrammarError(ValueError):
    """The constraint cannot be compiled (bad schema, regex or grammar): an HTTP 400."""


# Whitespace a JSON grammar allows between two tokens unless the request says otherwise
# (whitespace_pattern, disable_any_whitespace): nothing, one space, or one newline and an
# indentation. Free whitespace (llguidance's flexible default, and vLLM's) lets a small or
# sampled model write newlines until max_tokens and never close the object; one bounded run
# per gap keeps compact, spaced and pretty-printed JSON and bounds what the gaps can take.
BOUNDED_WHITESPACE = r"(?:\n[ \t]{0,32}| )"


class CompiledGrammar:
    """A validated grammar for one (constraint, tokenizer), held as a fresh llguidance matcher:
    building a matcher parses the grammar and builds its lexer, copying one is far cheaper, so
    every request's matcher is a copy of this one."""

    def __init__(self, template, compiler: "GrammarCompiler"):
        self._template = template
        self.compiler = compiler

    def matcher(self, after: Optional["ReasoningGate"] = None) -> "GrammarMatcher":
        return GrammarMatcher(self, after)


class GrammarMatcher:
    """One request's grammar state. The engine calls `accept` with every sampled token (in
    order), `rollback` when it discards tokens (speculation), and reads the next mask through
    `fill_banned_bits`."""

    def __init__(self, compiled: CompiledGrammar, after: Optional[ReasoningGate] = None):
        self.compiled = compiled
        self._m = compiled._template.deep_copy()
        # Before the constraint: "first" (the first token may open the reasoning), "reasoning"
        # (every token allowed, none fed, until the gate's closing tokens); None: constrained.
        self.gate = after
        self.phase = None if after is None else ("reasoning" if after.inside else "first")
        self._tail: list[int] = []

    def accept(self, token: int) -> bool:
        """Advance by one token; False (and an error state) if the grammar forbids it."""
        token = int(token)
        if self.phase == "first":
            self.phase = "reasoning" if token == self.gate.open else None
        if self.phase == "reasoning":
            close = self.gate.close
            self._tail = (self._tail + [token])[-len(close):]
            if tuple(self._tail) == close:
                self.phase = None
            return True
        return self._m.consume_token(token)

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        return all(self.accept(t) for t in tokens)

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar would accept, without advancing."""
        self._constrained("validate_tokens")
        return self._m.validate_tokens([int(t) for t in tokens])

    def _constrained(self, what: str) -> None:
        if self.phase is not None:  # speculation with a grammar is not scheduled (no caller)
            raise ValueError(f"{what} before the reasoning ends is not supported")

    def rollback(self, num_tokens: int) -> None:
        self._constrained("rollback")
        if not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll the grammar back by {num_tokens} tokens: "
                             f"{self._m.get_error()}")

    def is_terminated(self) -> bool:
        """The grammar is complete and cannot be extended (EOS is the only next token)."""
        return self.phase is None and self._m.is_stopped()

    def is_accepting(self) -> bool:
        """The text so far is a complete match (EOS would be allowed now)."""
        return self.phase is None and self._m.is_accepting()

    def is_error(self) -> bool:
        return self.phase is None and self._m.is_error()

    @property
    def error(self) -> Optional[str]:
        return self._m.get_error() if self._m.is_error() else None


class GrammarCompiler:
    """Compiles constraints against one tokenizer, caching by constraint (LRU); get one per
    tokenizer with `get_compiler`, which makes the cache per (constraint, tokenizer)."""

    def __init__(self, tokenizer, vocab_size: Optional[int] = None,
                 eos_token_ids: Optional[Sequence[int]] = None, cache_size: int = 256):
        import llguidance.hf

        self.vocab_size = int(vocab_size or len(tokenizer))  # the model's logits
        # llguidance needs every token of the tokenizer; a model may have fewer logits (its
        # masks are then cut to the model's width: tokens past it cannot be sampled anyway).
        self.mask_vocab_size = max(self.vocab_size, len(tokenizer))
        eos = list(eos_token_ids) if eos_token_ids else tokenizer.eos_token_id
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.mask_vocab_size,
                                                         eos_token=eos)
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self.num_compiles = 0  # cache misses

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        key = _cache_key(params)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        compiled = CompiledGrammar(self._template(params), self)
        _check_first_mask(compiled, params.kind)
        self.num_compiles += 1
        self._cache[key] = compiled
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        return self.compile(params).matcher()

    def _template(self, params: StructuredOutputsParams):
        import llguidance

        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                schema = json.loads(params.json) if kind == "json" else {"type": "object"}
                if params.disable_additional_properties:
                    schema = _close_objects(schema)
                options = {"whitespace_flexible": not params.disable_any_whitespace}
                if not params.disable_any_whitespace:
                    options["whitespace_pattern"] = (params.whitespace_pattern
                                                     or BOUNDED_WHITESPACE)
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                        overrides=options)
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", json.dumps(list(params.choice)))
            else:
                grammar = llguidance.grammar_from(kind, getattr(params, kind))
        except ValueError as e:  # a GBNF that does not convert, a schema that is not JSON
            raise GrammarError(f"invalid {kind}: {e}") from None
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid {kind}: {template.get_error().strip()[:500]}")
        return template


@functools.lru_cache(maxsize=8)
def get_compiler(tokenizer, vocab_size: Optional[int] = None,
                 eos_token_ids: Optional[tuple[int, ...]] = None) -> GrammarCompiler:
    """The shared compiler of a tokenizer: llguidance's token trie over the whole vocabulary
    takes too long to build more than once per tokenizer."""
    return GrammarCompiler(tokenizer, vocab_size, eos_token_ids)


def fill_banned_bits(rows: Sequence[tuple[GrammarMatcher, int]], bits: np.ndarray) -> None:
    """Writes each matcher's next-token mask into `bits[row]` as banned-token bits, in place.

    bits: the sampler's uint32 [S, ceil(V/32)] table (C-contiguous; V = the compiler's
    vocab_size). Rows not listed are left as they are, so grammar-free rows keep their own
    allowed_token_ids bans. The masks are computed in parallel on llguidance's thread pool.
    A matcher inside its reasoning bans nothing; at its first token it also allows the token
    that opens the reasoning."""
    rows = [(m, row) for m, row in rows if m.phase != "reasoning"]
    if not rows:
        return
    _fill(rows, bits)
    for m, row in rows:
        if m.phase == "first" and m.gate.open // 32 < bits.shape[1]:
            bits[row, m.gate.open // 32] &= ~np.uint32(1 << (m.gate.open % 32))


def _fill(rows: Sequence[tuple[GrammarMatcher, int]], bits: np.ndarray) -> None:
    if bits.dtype != np.uint32 or bits.ndim != 2 or not bits.flags["C_CONTIGUOUS"]:
        raise ValueError("bits must be a C-contiguous uint32 [S, words] array")
    words = bits.shape[1]
    compilers = {m.compiled.compiler for m, _ in rows}
    for m, row in rows:
        if -(-m.compiled.compiler.vocab_size // 32) != words or not 0 <= row < bits.shape[0]:
            raise ValueError(f"row {row} of a {bits.shape} bitmask does not fit a grammar over "
                             f"{m.compiled.compiler.vocab_size} tokens")
    index = np.fromiter((row for _, row in rows), np.int64, len(rows))
    mask_words = max(-(-c.mask_vocab_size // 32) for c in compilers)
    if mask_words == words:  # in place
        _executor().unsafe_compute_mask_ptr([(m._m, row) for m, row in rows], bits.ctypes.data,
                                            words * 4, bits.shape[0])
        bits[index] = ~bits[index]
        return
    wide = np.zeros((len(rows), mask_words), np.uint32)  # the tokenizer is wider than the model
    _executor().unsafe_compute_mask_ptr([(m._m, i) for i, (m, _) in enumerate(rows)],
                                        wide.ctypes.data, mask_words * 4, len(rows))
    bits[index] = ~wide[:, :words]


def _check_first_mask(compiled: CompiledGrammar, kind: str) -> None:
    """Compute the first mask as the engine will (cheap next to the compile): a grammar that
    allows no token at the start is refused here (a 400) rather than ending its request at once
    with "error".
    Seen with a model narrower than its tokenizer: `{"values":[` forced by a schema may be
    allowed only as tokens past the model's logits."""
    probe = compiled.matcher()
    V = compiled.compiler.vocab_size
    bits = np.zeros((1, -(-V // 32)), np.uint32)
    fill_banned_bits([(probe, 0)], bits)
    if probe.is_error() or np.unpackbits(bits.view(np.uint8), bitorder="little")[:V].all():
        why = probe.error or "no token of the model's vocabulary can start it"
        raise GrammarError(f"invalid {kind}: {why.strip()[:500]}")


@functools.lru_cache(maxsize=1)
def _executor():
    import llguidance

    return llguidance.LLExecutor()


def _cache_key(p: StructuredOutputsParams) -> tuple:
    # `backend` and `disable_fallback` do not change the grammar (one engine, no fallback).
    return (p.json, p.regex, p.choice, p.grammar, p.json_object, p.disable_any_whitespace,
            p.disable_additional_properties, p.whitespace_pattern)


def _close_objects(schema):
    """vLLM's disable_additional_properties: every object schema without an explicit
    additionalProperties gets `false`, recursively."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
