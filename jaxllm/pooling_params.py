"""PoolingParams: what an embedding/pooling request asks of the pooler, with vLLM's fields.

Fields vLLM has and jaxllm cannot honour are refused by name rather than ignored: `dimensions`
(Matryoshka truncation; no supported model is trained for it) and `truncate_prompt_tokens`.
As in vLLM 0.32, `use_activation` is what older versions called `normalize` (for embeddings,
the activation is the L2 normalization; for a classifier, its softmax or sigmoid).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# embed: one vector per prompt (the model's pooling); token_embed: one per prompt token;
# classify: a classifier's label probabilities; score: a cross-encoder's relevance of a pair.
POOLING_TASKS = ("embed", "token_embed", "classify", "score")
TYPE_START = "compressed_token_type_ids"


@dataclass
class PoolingParams:
    use_activation: Optional[bool] = None  # None: as the model's pooler says
    dimensions: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None
    task: Optional[str] = None        # None: embed
    # vLLM's per-request extras; the one taken: compressed_token_type_ids, where a sequence
    # pair's second segment starts (token type 1 from there; an encoder cross-encoder's
    # `tokenizer(text_1, text_2)`, jaxllm/entrypoints/score_utils.py).
    extra_kwargs: Optional[dict] = None

    def __post_init__(self):
        if self.dimensions is not None:
            raise ValueError("dimensions is not supported: this model does not support "
                             "Matryoshka representation (embedding truncation)")
        if self.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens is not supported by this server")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task={self.task!r} is not supported (supported: "
                             f"{', '.join(POOLING_TASKS)})")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError("use_activation must be a boolean")
        unknown = sorted(set(self.extra_kwargs or ()) - {TYPE_START})
        if unknown:
            raise ValueError(f"extra_kwargs {unknown} are not supported (supported: "
                             f"{TYPE_START})")
        start = (self.extra_kwargs or {}).get(TYPE_START)
        if start is not None and (isinstance(start, bool) or not isinstance(start, int)
                                  or start < 0):
            raise ValueError(f"extra_kwargs {TYPE_START} must be a non-negative integer")

    @property
    def type_start(self) -> Optional[int]:
        """Where token type 1 starts (None: one segment)."""
        return (self.extra_kwargs or {}).get(TYPE_START)
