"""What a step is while it runs and after: the tokens a step sampled (`SampleResult`), a
dispatched step whose results are still on the device (`Inflight`), one step of a burst
(`BurstStep`), and what step hooks are shown (`StepEvent`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from jaxllm.layers.sampling_tensors import SamplingTensors
from jaxllm.sequence import SchedulerOutput, Sequence
from jaxllm.worker.input_batch import PromptRows, StepInputs


@dataclass
class SampleResult:
    token: int
    logprob: Optional[float] = None
    rank: Optional[int] = None
    top: tuple = ()  # ((token_id, logprob), ...) best first


@dataclass
class Inflight:
    """A dispatched step whose results are still on the device."""
    sched: SchedulerOutput
    seqs: list[Sequence]  # the sequences sampled, in row order
    out: Any              # SamplerOutput (device arrays) or None
    prompt_rows: list[PromptRows]
    prompt: Any           # prompt-logprobs results (device arrays) or None
    expert_load: Any = None  # int32 [MoE layers, experts] on the device, when counted
    hidden: Optional["StepHidden"] = None  # kept for an MTP drafter (ModelRunner keep_hidden)


@dataclass
class StepHidden:
    """A step's final (normed) hidden states, every token's row [T, E] on the device, with the
    step's positions and attention metadata (host arrays) that place each row: what an MTP
    drafter continues from (jaxllm/spec_decode/mtp.py)."""
    hidden: Any
    positions: Any
    metadata: Any


@dataclass
class BurstStep:
    """One step of a burst: its Inflight (tokens filled in by dispatch_burst), host arrays."""
    inflight: Inflight
    inputs: StepInputs
    tensors: SamplingTensors


@dataclass
class StepEvent:
    """What a step hook (`ModelRunner.add_step_hook`) is shown: tests and profilers observe or
    delay steps through it, and inject faults by raising (the step fails as on a device error).
    kind: 'dispatch' (one step launched), 'burst' (several launched as one program) or
    'collect' (one step read back)."""
    kind: str
    steps: list[Inflight]
    chained: bool = False  # launched before the step it follows was read (async scheduling)
    sampled: Optional[dict] = None          # collect: seq_id -> [SampleResult, ...]
    prompt_logprobs: Optional[dict] = None  # collect: seq_id -> (first, [SampleResult, ...])


def sample_result(out, i: int, seq: Sequence) -> SampleResult:
    """Row i of the sampler's host output, as the sequence asked for it (logprobs or not)."""
    k = seq.sampling_params.logprobs
    if k is None:
        return SampleResult(int(out.token_ids[i]))
    top = tuple(zip(out.top_token_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist()))
    return SampleResult(int(out.token_ids[i]), float(out.logprobs[i]), int(out.ranks[i]), top)


def prompt_results(out, prompt_rows: list[PromptRows]) -> dict[str, tuple]:
    """The prompt-logprobs program's host output, split per sequence, top-k cut to its k."""
    logprobs, ranks, top_logprobs, top_ids = out
    results, n = {}, 0
    for pr in prompt_rows:
        seq, m = pr.seq, len(pr.rows)
        k = seq.sampling_params.prompt_logprobs
        targets = seq.prompt_token_ids[pr.first:pr.first + m]
        rows = zip(targets, logprobs[n:n + m].tolist(), ranks[n:n + m].tolist(),
                   top_ids[n:n + m, :k].tolist(), top_logprobs[n:n + m, :k].tolist())
        results[seq.seq_id] = (pr.first, [SampleResult(t, lp, r, tuple(zip(ids, lps)))
                                              for t, lp, r, ids, lps in rows])
        n += m
    return results
