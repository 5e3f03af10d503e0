"""Draft proposers: what a speculative method must provide, the n-gram one, and the factory.

A proposer guesses up to k next tokens of each running request; the target model then scores
them all in one step (jaxllm/spec_decode/speculator.py, jaxllm/spec_decode/acceptance.py).
Proposals are deterministic guesses (n-gram lookup, or a draft model's argmax), so the
verification is exact for any sampling parameters: see acceptance.py.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from jaxllm.config import ConfigError
from jaxllm.sequence import Sequence
from jaxllm.spec_decode import ngram
from jaxllm.spec_decode.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], k: int,
                limits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for each sequence after its last token (all its tokens are known): int32
        [R, k], -1 past each row's count; counts int32 [R], at most limits[r]."""

    def free(self, seq_id: str) -> None:
        """The sequence finished or was aborted: drop what the proposer keeps for it."""


class NgramProposer:
    """vLLM's "ngram" method: prompt lookup over the request's own prompt and output."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], k: int,
                limits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.array([s.num_tokens for s in seqs], np.int64)
        tokens = np.zeros((len(seqs), int(lengths.max())), np.int32)
        for r, s in enumerate(seqs):
            p = s.num_prompt_tokens
            tokens[r, :p] = s.prompt_token_ids
            tokens[r, p:lengths[r]] = s.output_token_ids
        return ngram.propose(tokens, lengths, k, self.min_n, self.max_n, limits)

    def free(self, seq_id: str) -> None:
        pass  # stateless: every proposal reads the sequence's tokens afresh


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The host-only proposer of `config`. A draft model needs the engine's arguments, devices
    and cache size: jaxllm/spec_decode/draft_model.py's build_speculator makes that one."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ConfigError(f"--speculative-config: method {config.method!r} needs the engine's "
                      f"model and devices (build_speculator), not make_proposer")
