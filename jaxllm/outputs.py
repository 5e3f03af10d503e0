"""What `LLM.generate` and the engine return, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

from jaxllm.lora.request import LoRARequest

if TYPE_CHECKING:
    import numpy as np

# One position's logprobs: token id -> Logprob (the sampled token first, then the top-k).
LogprobDict = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[LogprobDict]]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[LogprobDict]]]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    lora_request: Optional[LoRARequest] = None  # the adapter it ran with (vLLM's field)


# --- pooling (LLM.encode / LLM.embed) -----------------------------------------------------------

@dataclass
class PoolingOutput:
    data: "np.ndarray"  # float32: [E] pooled, or [tokens, E] for task token_embed


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: Optional[str] = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, EmbeddingOutput(out.outputs.data.tolist()),
                   out.prompt_token_ids, out.finished)


# --- classification and scoring (LLM.classify / LLM.score) --------------------------------------

@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (the raw logits when use_activation=False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(out.request_id, ClassificationOutput(out.outputs.data.tolist()),
                   out.prompt_token_ids, out.finished)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the pair's tokens (a cross-encoder's input, or both texts')
    finished: bool = True
