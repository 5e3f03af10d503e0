"""Scoring text pairs (`LLM.score`, /score, /rerank) as vLLM does, on either kind of pooling
model: a cross-encoder (a classifier with one label) scores each pair's joint encoding,
`tokenizer(text_1, text_2)`, through its sigmoid; an embedding model scores the cosine
similarity of the two texts' embeddings.

An encoder cross-encoder (BERT) also reads the pair's token types, segment 0 for text_1 and 1
for text_2 (`[CLS] q [SEP] d [SEP]`): each prompt carries them as vLLM's compressed form,
where segment 1 starts (PoolingParams.extra_kwargs), in its own PoolingParams
(`ScoreJob.prompt_params`). Tokenizers that give no token types (decoders', RoBERTa's) add
nothing.

The pairing is vLLM's: a single text_1 (a string, or a list of one) is scored against every
text_2 (1:N); lists of equal length are scored pairwise (N:N); any other shape is refused.
A `ScoreJob` is the prompts to pool and how their outputs become scores, so the offline API
and the server (which pools each prompt on the engine thread) share it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

import numpy as np

from jaxllm.outputs import PoolingRequestOutput
from jaxllm.pooling_params import TYPE_START, PoolingParams

Texts = Union[str, Sequence[str]]


def score_pairs(data_1: Texts, data_2: Texts) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score, in order; ValueError for a shape vLLM refuses."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, texts in (("text_1", first), ("text_2", second)):
        if not texts:
            raise ValueError(f"{name}: at least one text must be given")
        if not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name}: scoring takes texts (strings)")
    if len(first) > 1 and len(first) != len(second):
        raise ValueError(f"text_1 and text_2: input lengths must be either 1:1, 1:N or N:N "
                         f"(got {len(first)}:{len(second)})")
    if len(first) == 1:
        first = first * len(second)
    return list(zip(first, second))


def compress_token_type_ids(token_type_ids: Optional[Sequence[int]]) -> Optional[int]:
    """vLLM's compressed token type ids: where the ones start (None: no token types, or all
    zeros); ValueError unless they are zeros then ones."""
    if token_type_ids is None:
        return None
    types = list(token_type_ids)
    start = next((i for i, t in enumerate(types) if t != 0), len(types))
    if any(t != 1 for t in types[start:]):
        raise ValueError("token type ids are expected to be zeros followed by ones")
    return None if start == len(types) else start


def cosine(a: np.ndarray, b: np.ndarray, eps: float = 1e-8) -> float:
    """torch.nn.CosineSimilarity(dim=0) of two vectors, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (max(np.linalg.norm(a), eps) * max(np.linalg.norm(b), eps)))


def score_tasks_error(tasks: Sequence[str], num_labels: Optional[int]) -> Optional[str]:
    """Why a model with these pooling tasks cannot score (None: it can)."""
    if "score" in tasks or "embed" in tasks:
        return None
    if "classify" in tasks:
        return (f"Score API is only enabled for num_labels == 1 (this classifier has "
                f"{num_labels} labels).")
    return ("Score API is only supported for pooling models: a cross-encoder (a "
            "*ForSequenceClassification checkpoint with one label) or an embedding model; "
            "this one runs with --runner generate.")


@dataclass
class ScoreJob:
    """The prompts (token ids) to pool with `params`, and for each pair which outputs give
    its score: one cross-encoder output, or two embeddings."""
    prompts: list[list[int]]
    params: PoolingParams
    pairs: list[tuple[int, ...]]
    pad: list[int]
    type_starts: Optional[list[Optional[int]]] = None  # per prompt: where segment 1 starts

    @property
    def prompt_params(self) -> list[PoolingParams]:
        """Each prompt's PoolingParams: `params`, with its token types where it has two
        segments."""
        starts = self.type_starts or [None] * len(self.prompts)
        return [self.params if s is None else
                replace(self.params, extra_kwargs={TYPE_START: s}) for s in starts]

    @classmethod
    def build(cls, tasks: Sequence[str], tokenizer, pairs: list[tuple[str, str]],
              use_activation: Optional[bool] = None,
              num_labels: Optional[int] = None) -> "ScoreJob":
        why = score_tasks_error(tasks, num_labels)
        if why is not None:
            raise ValueError(why)
        if tokenizer is None:
            raise ValueError("scoring texts needs the tokenizer (started with "
                             "--skip-tokenizer-init)")
        if "score" in tasks:
            encs = [tokenizer(a, b) for a, b in pairs]
            return cls([list(e["input_ids"]) for e in encs],
                       PoolingParams(use_activation=use_activation, task="score"),
                       [(i,) for i in range(len(pairs))], [],
                       [compress_token_type_ids(e.get("token_type_ids")) for e in encs])
        index: dict[str, int] = {}  # each distinct text is embedded once (1:N's query)
        prompts = []
        for text in (t for pair in pairs for t in pair):
            if text not in index:
                index[text] = len(prompts)
                prompts.append(tokenizer.encode(text))
        pad = [] if tokenizer.pad_token_id is None else [tokenizer.pad_token_id]
        return cls(prompts, PoolingParams(task="embed"),
                   [(index[a], index[b]) for a, b in pairs], pad)

    def scores(self, outputs: list[PoolingRequestOutput]) -> list[tuple[float, list[int]]]:
        """(score, the pair's prompt tokens) per pair: an embedding pair's tokens are both
        texts' with the pad token between, as vLLM counts them."""
        out = []
        for pair in self.pairs:
            if len(pair) == 1:
                res = outputs[pair[0]]
                out.append((float(res.outputs.data[0]), list(res.prompt_token_ids)))
            else:
                a, b = outputs[pair[0]], outputs[pair[1]]
                out.append((cosine(a.outputs.data, b.outputs.data),
                            list(a.prompt_token_ids) + self.pad + list(b.prompt_token_ids)))
        return out
