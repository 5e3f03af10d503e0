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
