"""The engine's side of speculative decoding: who gets drafts this step, and the counters.

Before each schedule the engine asks `Speculator.propose` for drafts of the running requests
that can take them; the scheduler gives a drafted request 1 + k tokens, the runner samples all
of their positions and keeps the matching prefix (acceptance.py), and `record` counts what was
proposed and accepted under vLLM's metric names. Drafts follow a request's last token, so a
step that may propose first reads the step in flight, giving up async scheduling's overlap of
host and device work; a step where nobody may (see `wants_tokens`) keeps it, and costs what
it costs without speculation. When lookup finds drafts that the model rejects, each costs a
wider step (and the overlap) for nothing, so a request whose drafts were all rejected rests
from proposing for 1, 2, 4, ... up to MAX_BACKOFF steps (reset by any acceptance): on text
where guesses keep failing speculation all but switches itself off. The engine remembers the
rest the last rejection reached (any request's, until any request accepts a draft), and a
request's first rejection rests that long: where no request's drafts are accepted (a draft
model that never agrees), each new request probes once and rests, instead of climbing 1, 2,
4, ... again (with a draft model each probe costs several plain steps, so a climb's probes
would add a sizeable share to a short request's time; docs/performance.md has the figures).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxllm.sequence import SchedulerOutput, Sequence, SequenceStatus
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.proposer import Proposer, make_proposer

# Steps a request rests at most after its drafts were all rejected. Where nothing is ever
# accepted, 1 step in MAX_BACKOFF + 1 still probes, at up to ~2x a plain step's cost (a draft
# model's K passes plus the wider verify): 64 keeps that near 1.5 % (16: ~6 %), and speculation
# resumes at most 64 steps late when the text turns repetitive.
MAX_BACKOFF = 64


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding's counters, as vLLM's spec_decode metrics."""
    num_drafts: int = 0           # request-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    num_steps: int = 0            # steps collected, with drafts or not


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 proposer: Proposer | None = None):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = min(max_model_len, config.max_model_len or max_model_len)
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.num_drafts = 0          # requests-steps that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k  # drafts accepted at position 0, 1, ...
        self.num_steps = 0           # steps collected (with drafts or not)
        self._rest: dict[str, list[int]] = {}  # seq_id -> [steps left to rest, last rest]
        self._engine_rest = 0  # the last rest a rejection set, until a draft is accepted

    def wants_tokens(self, running: list[Sequence]) -> bool:
        """Whether the step in flight must be read before this step: some request whose last
        token is in flight may get drafts (they follow that token). If none may (all resting,
        speculation disabled by batch size, or, for n-gram lookup, no earlier occurrence of
        what precedes that token), the engine keeps async scheduling's overlap: a step
        without drafts costs what it costs without speculation."""
        if not self._enabled(running):
            return False
        seqs = [s for s in running if s.has_pending and self._eligible(s)
                and not self._rest.get(s.seq_id, (0,))[0]]
        return bool(seqs) and bool(self.proposer.may_propose(seqs).any())

    def propose(self, running: list[Sequence]) -> dict[str, list[int]]:
        """{seq_id: drafts} for the running requests that decode with all tokens known and
        no grammar (whose mask would need the drafts fed to its matcher), unless
        disable_by_batch_size requests or more run. Drafts never run past max_tokens or
        max_model_len: the step's last token (accepted run plus one) still fits. Called once
        per step: a resting request's rest counts down here."""
        resting = {s.seq_id for s in running if self._resting(s.seq_id)}
        if not self._enabled(running):
            return {}
        seqs = [s for s in running if self._eligible(s) and not s.has_pending
                and s.seq_id not in resting]
        if not seqs:
            return {}
        limits = np.array([min(self.max_model_len - s.num_tokens,
                               (s.sampling_params.max_tokens or self.max_model_len)
                               - s.num_output_tokens) - 1 for s in seqs], np.int64)
        drafts, counts = self.proposer.propose(seqs, self.k, np.clip(limits, 0, self.k))
        return {s.seq_id: drafts[r, :counts[r]].tolist() for r, s in enumerate(seqs)
                if counts[r] > 0}

    def _enabled(self, running: list[Sequence]) -> bool:
        off = self.config.disable_by_batch_size
        return bool(running) and (off is None or len(running) < off)

    @staticmethod
    def _eligible(s: Sequence) -> bool:
        """Decoding (one new token), no grammar: the last token may still be in flight."""
        return (s.status == SequenceStatus.RUNNING and s.grammar is None
                and s.num_tokens - s.num_computed_tokens == 1)

    def record(self, sched: SchedulerOutput, sampled: dict[str, list], hidden=None) -> None:
        """Count a collected step, its drafts and how many of each position were accepted;
        the proposer sees the step first (`observe`: an MTP layer reads its hidden states,
        `hidden`, the step's StepHidden when the runner keeps them)."""
        self.proposer.observe(sched, sampled, hidden)
        drafted = [s for s in sched.scheduled if s.spec_token_ids and s.seq.seq_id in sampled]
        for s in drafted:
            accepted = len(sampled[s.seq.seq_id]) - 1
            self.num_drafts += 1
            self.num_draft_tokens += len(s.spec_token_ids)
            self.num_accepted_tokens += accepted
            self._backoff(s.seq.seq_id, accepted)
            for j in range(accepted):
                self.accepted_per_pos[j] += 1
        self.num_steps += 1

    def free(self, seq_id: str) -> None:
        self.proposer.free(seq_id)
        self._rest.pop(seq_id, None)

    def _resting(self, seq_id: str) -> bool:
        rest = self._rest.get(seq_id)
        if rest is None or rest[0] == 0:
            return False
        rest[0] -= 1
        return True

    def _backoff(self, seq_id: str, accepted: int) -> None:
        if accepted:
            self._rest.pop(seq_id, None)
            self._engine_rest = 0
            return
        last = self._rest.get(seq_id, [0, 0])[1]
        rest = min(2 * last, MAX_BACKOFF) if last else max(1, self._engine_rest)
        self._rest[seq_id] = [rest, rest]
        self._engine_rest = rest

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               tuple(self.accepted_per_pos), self.num_steps)
