"""Request and response bodies of /classify, /score (/v1/score) and /rerank (/v1/rerank,
/v2/rerank), with vLLM's fields, on a --runner pooling server (a classifier, a cross-encoder,
or for /score and /rerank an embedding model)."""

from __future__ import annotations

import time
from typing import Optional, Union

from pydantic import BaseModel, Field

from serving.protocol import RequestBody, UsageInfo, random_id


class ScoringBody(RequestBody):
    model: Optional[str] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None  # refused (as on /v1/embeddings)
    use_activation: Optional[bool] = None  # False: the raw logits


class ClassificationRequest(ScoringBody):
    input: Union[str, list[str], list[int], list[list[int]]]
    add_special_tokens: bool = True


class ScoreRequest(ScoringBody):
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]


class RerankRequest(ScoringBody):
    query: str
    documents: list[str]
    top_n: int = 0  # 0 (or more than there are documents): all of them


class ClassificationData(BaseModel):
    index: int
    label: Optional[str]
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"classify-{random_id()}")
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreResponseData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"score-{random_id()}")
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    text: Optional[str] = None


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{random_id()}")
    model: str
    usage: RerankUsage
    results: list[RerankResult]
