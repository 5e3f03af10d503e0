"""Request and response bodies of /v1/completions (and its streamed chunks), built on the shared
request fields of serving/protocol.py (`SamplingRequest`), as the chat endpoint's are.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator

from serving.errors import APIError
from serving.protocol import SamplingRequest, UsageInfo


class CompletionRequest(SamplingRequest):
    beam_search_supported: ClassVar[bool] = True
    # vLLM's (--enable-prompt-embeds): base64 torch.save tensors [tokens, hidden size], one
    # prompt each, in place of `prompt` (serving/prompt_embeds.py reads them). Declared first:
    # `prompt`'s validator reads it.
    prompt_embeds: Optional[Union[str, list[str]]] = None
    prompt: Optional[Union[str, list[str], list[int], list[list[int]]]] = Field(
        None, validate_default=True)
    echo: bool = False
    logprobs: Optional[int] = None
    max_tokens: Optional[int] = 16
    suffix: Optional[str] = None
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _prompt_or_embeds(cls, value, info):
        if value is None and info.data.get("prompt_embeds") is None:
            raise ValueError("Field required (prompt, or prompt_embeds with "
                             "--enable-prompt-embeds)")
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix is not None:
            raise APIError("suffix is not supported.", param="suffix")
        if (self.prompt is None) == (self.prompt_embeds is None):
            raise APIError("Give either prompt or prompt_embeds (one of the two).",
                           param="prompt")
        if self.prompt_embeds is not None:
            for name, on in (("echo", self.echo), ("use_beam_search", self.use_beam_search)):
                if on:
                    raise APIError(f"{name} is not supported with prompt_embeds (the prompt's "
                                   "tokens are unknown).", param=name)


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, dict[str, Any]]]]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class CompletionResponseStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None
