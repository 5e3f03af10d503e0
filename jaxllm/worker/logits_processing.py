"""The sampler of an engine started with custom logits processors (jaxllm/logits_processor.py).

Without processors a step's sampler is one program over the rows' hidden states: the logits
never leave the device (nor exist whole: `sample_rows` computes them a chunk of rows at a time).
A processor is user Python over the whole batch's logits, so here the step splits in two: a
program computes the logits of the rows that sample ([B, V], B the smallest power of two that
holds them), they come to the host, each processor updates its view of the batch and
transforms them, and a second program samples the result with the requests' own parameters.
Logprobs stay vLLM's raw ones: of the logits before the processors (and the sampler's own
penalties), computed on the device copy the processors never saw.

The processors see the batch as vLLM's persistent batch: row i is the step's i-th sampling
sequence; a row whose sequence changed since the last step is reported removed and its new
sequence added (with its live output-token list), so a processor's per-row state always
matches the row's sequence. Sequences mid-prefill sample nothing and so are not in the batch.
"""

from __future__ import annotations

from typing import Sequence as Seq

import jax
import numpy as np
from flax import nnx

from jaxllm.layers.sampler import SamplerOutput, sample_rows, token_logprobs
from jaxllm.logits_processor import BatchUpdate, LogitsProcessor
from jaxllm.sequence import SamplingTensors, Sequence


class ProcessedSampling:
    def __init__(self, processors: Seq[LogitsProcessor], graphdef, vocab_size: int,
                 max_logprobs: int, penalty_width: int, logit_rows: tuple[int, ...]):
        self.processors = tuple(processors)
        self.graphdef, self.vocab_size = graphdef, vocab_size
        self.max_logprobs, self.penalty_width = max_logprobs, penalty_width
        self.logit_rows = logit_rows
        self._batch: list[str] = []  # each row's sequence, as the processors last saw it
        self._logits = jax.jit(self._logits_fn, static_argnums=2)
        self._sample = jax.jit(self._sample_fn)
        self._raw_logprobs = jax.jit(token_logprobs, static_argnums=2)

    def _logits_fn(self, state, rows, num_rows: int):
        return nnx.merge(self.graphdef, state).compute_logits(rows[:num_rows])

    def _sample_fn(self, state, logits, num_rows, tensors):
        model = nnx.merge(self.graphdef, state)
        return sample_rows(logits, num_rows, lambda x: x, tensors, logit_rows=self.logit_rows,
                           draw=model.backend.draw())

    def batch_update(self, seqs: list[Sequence]):
        """What changed in the batch since the last step (None: nothing)."""
        now = [s.seq_id for s in seqs]
        old = self._batch
        removed = [i for i, sid in enumerate(old) if i >= len(now) or now[i] != sid]
        added = [(i, s.sampling_params, s.prompt_token_ids, s.output_token_ids)
                 for i, s in enumerate(seqs) if i >= len(old) or old[i] != s.seq_id]
        self._batch = now
        return BatchUpdate(len(now), removed, added, []) if removed or added else None

    def sample(self, state, rows, seqs: list[Sequence]) -> SamplerOutput:
        """rows [S, E]: the step's hidden states of its sampling rows, `seqs` in order."""
        n = len(seqs)
        padded = min(1 << (n - 1).bit_length(), rows.shape[0])
        update = self.batch_update(seqs)
        for p in self.processors:
            p.update_state(update)
        raw = self._logits(state, rows, padded)
        logits = np.array(raw, np.float32)
        batch = logits[:n]
        all_greedy = all(s.sampling_params.greedy for s in seqs)
        for p in self.processors:
            if all_greedy and p.is_argmax_invariant():
                continue
            batch = p.apply(batch)
            if not (isinstance(batch, np.ndarray) and batch.shape == (n, self.vocab_size)):
                raise ValueError(f"logits processor {type(p).__name__}.apply returned "
                                 f"{type(batch).__name__} {getattr(batch, 'shape', '')}, not a "
                                 f"NumPy array of shape {(n, self.vocab_size)}")
        logits[:n] = batch
        tensors = SamplingTensors.from_seqs(seqs, pad_to=padded, vocab_size=self.vocab_size,
                                            max_logprobs=self.max_logprobs,
                                            penalty_width=self.penalty_width)
        out = self._sample(state, logits, np.int32(n), tensors)
        if tensors.num_logprobs is None:
            return out
        # vLLM's logprobs (raw_logprobs) are of the logits before any processing.
        return SamplerOutput(out.token_ids,
                             *self._raw_logprobs(raw, out.token_ids, tensors.num_logprobs))
