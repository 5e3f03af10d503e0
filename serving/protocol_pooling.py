"""Request and response bodies of /v1/embeddings and /pooling (a server started with
`--runner pooling`), apart from the generation API's bodies in serving/protocol.py and
serving/protocol_completion.py.
"""

from __future__ import annotations

import time
from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from serving.protocol import RequestBody, UsageInfo, random_id


class EmbeddingRequest(RequestBody):
    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    # vLLM's extras (its `normalize` is now `use_activation`; the old name is refused).
    add_special_tokens: bool = True
    use_activation: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None
    embed_dtype: Literal["float32"] = "float32"
    endianness: Literal["native", "little"] = "native"


class PoolingRequest(EmbeddingRequest):
    task: Optional[str] = None  # embed (default) or token_embed


class EmbeddingData(BaseModel):
    index: int
    object: str = "embedding"
    embedding: Union[list[float], str]


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"embd-{random_id()}")
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class PoolingData(BaseModel):
    index: int
    object: str = "pooling"
    data: Union[list[float], list[list[float]], str]


class PoolingResponse(EmbeddingResponse):
    id: str = Field(default_factory=lambda: f"pool-{random_id()}")
    data: list[PoolingData]
