"""Beam search as vLLM runs it: in the frontend, one engine request per beam per step.

Each step asks the engine for one token of every live beam with the 2 x beam_width most likely
next tokens (logprobs); each beam's candidates are scored by cumulative logprob / length **
length_penalty (vLLM's `get_beam_search_score`: the length counts the prompt, and not a final
EOS); a candidate ending in EOS completes (unless ignore_eos) and the best beam_width others
live on. After max_tokens steps the best beam_width of completed and live beams are returned.
Prefix caching makes the repeated prompts cheap. `BeamSearch` holds the state; the offline
`LLM.beam_search` and the server's `use_beam_search` each drive it with their own engine call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# BeamSearchParams is a host type defined with SamplingParams (as vLLM's); re-exported here.
from jaxllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """tokens: the prompt's and the generated ones (as vLLM); text: the generated text."""
    tokens: list[int]
    logprobs: list[dict] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids, length_penalty: float
               ) -> float:
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (seq_len ** length_penalty)


class BeamSearch:
    """The beams of several prompts; `pending()` -> the token lists to extend by one step,
    `advance(logprob dicts)` with each one's next-token logprobs, until `done`."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids,
                 max_model_len: int, max_logprobs: int):
        if 2 * params.beam_width > max_logprobs:
            raise ValueError(f"beam_width={params.beam_width} needs {2 * params.beam_width} "
                             f"logprobs per step; this engine allows {max_logprobs} "
                             f"(--max-logprobs)")
        self.params, self.eos = params, frozenset(eos_token_ids)
        self.prompt_lens = [len(p) for p in prompts]
        self.beams = [[BeamSearchSequence(list(p))] for p in prompts]
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        # Every beam of a prompt has the same length, so each prompt stops at its own budget.
        self.steps_left = [min(params.max_tokens, max_model_len - len(p)) for p in prompts]
        self.sampling_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width,
                                              temperature=params.temperature, detokenize=False)

    @property
    def done(self) -> bool:
        return not any(b and s > 0 for b, s in zip(self.beams, self.steps_left))

    def pending(self) -> list[list[int]]:
        return [b.tokens for i, bs in enumerate(self.beams) if self.steps_left[i] > 0
                for b in bs]

    def _key(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty)

    def advance(self, next_logprobs: list[dict]) -> None:
        """next_logprobs[j]: {token id: Logprob} after pending()[j]."""
        it = iter(next_logprobs)
        for i, beams in enumerate(self.beams):
            if self.steps_left[i] <= 0:
                continue
            candidates = []
            for beam in beams:
                lps = next(it)
                for tok, lp in lps.items():
                    new = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [lps],
                                             beam.cum_logprob + lp.logprob)
                    if tok in self.eos and not self.params.ignore_eos:
                        new.finish_reason, new.stop_reason = "stop", tok
                        self.completed[i].append(new)
                    else:
                        candidates.append(new)
            self.beams[i] = sorted(candidates, key=self._key, reverse=True)[
                :self.params.beam_width]
            self.steps_left[i] -= 1

    def outputs(self, tokenizer) -> list[BeamSearchOutput]:
        """The best beam_width sequences of each prompt, best first, with their text."""
        outs = []
        for i, (beams, done) in enumerate(zip(self.beams, self.completed)):
            for b in beams:
                b.finish_reason = "length"
            best = sorted(done + beams, key=self._key, reverse=True)[:self.params.beam_width]
            for b in best:
                gen = b.tokens[self.prompt_lens[i]:]
                if (b.finish_reason == "stop" and not self.params.include_stop_str_in_output):
                    gen = gen[:-1]  # the EOS is not part of the text
                b.text = tokenizer.decode(gen) if tokenizer is not None else None
            outs.append(BeamSearchOutput(best))
        return outs
