"""Draft proposers: what a speculative method must provide, the n-gram one, and the factory.

A proposer guesses up to k next tokens of each running request; the target model then scores
them all in one step (jaxllm/spec_decode/speculator.py, jaxllm/spec_decode/acceptance.py).
Proposals are deterministic guesses (n-gram lookup, a draft model's or MTP layer's argmax), so the
verification is exact for any sampling parameters: see acceptance.py.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from jaxllm.config import ConfigError
from jaxllm.sequence import SchedulerOutput, Sequence
from jaxllm.spec_decode import ngram
from jaxllm.spec_decode.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], k: int,
                limits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for each sequence after its last token (all its tokens are known): int32
        [R, k], -1 past each row's count; counts int32 [R], at most limits[r]."""

    def may_propose(self, seqs: list[Sequence]) -> np.ndarray:
        """bool [R]: whether each sequence, whose last token is still being computed, could
        get drafts once it is known. False must be certain (the engine then keeps async
        overlap instead of reading that token first); True may be a guess."""

    def free(self, seq_id: str) -> None:
        """The sequence finished or was aborted: drop what the proposer keeps for it."""

    def observe(self, sched: SchedulerOutput, sampled: dict, hidden) -> None:
        """A target step was collected (before its tokens are placed): `sampled` its kept
        SampleResults per sequence, `hidden` its StepHidden (None unless the runner keeps
        them). Only the MTP proposer reads it."""


class NgramProposer:
    """vLLM's "ngram" method: prompt lookup over the request's own prompt and output."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], k: int,
                limits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ngram.propose(*_padded(seqs), k, self.min_n, self.max_n, limits)

    def may_propose(self, seqs: list[Sequence]) -> np.ndarray:
        """A match of the last n >= min_n tokens ends with a match of the n - 1 known ones
        before the last: without an earlier occurrence of the known tokens' last min_n - 1,
        lookup will find nothing whatever the last token is (min_n = 1: anything may match)."""
        if self.min_n == 1:
            return np.ones(len(seqs), bool)
        tokens, lengths = _padded(seqs)
        n = self.min_n - 1
        return ngram.propose(tokens, lengths - 1, 1, n, n)[1] > 0

    def free(self, seq_id: str) -> None:
        pass  # stateless: every proposal reads the sequence's tokens afresh

    def observe(self, sched: SchedulerOutput, sampled: dict, hidden) -> None:
        pass


def _padded(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's prompt and output tokens as rows of a padded int32 array, and lengths."""
    lengths = np.array([s.num_tokens for s in seqs], np.int64)
    tokens = np.zeros((len(seqs), int(lengths.max())), np.int32)
    for r, s in enumerate(seqs):
        p = s.num_prompt_tokens
        tokens[r, :p] = s.prompt_token_ids
        tokens[r, p:lengths[r]] = s.output_token_ids
    return tokens, lengths


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The host-only proposer of `config`. A draft model needs the engine's config, devices
    and cache size: jaxllm/spec_decode/draft_model.py's build_speculator makes that one."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ConfigError(f"--speculative-config: method {config.method!r} needs the engine's "
                      f"model and devices (build_speculator), not make_proposer")
