"""Request and response bodies of the OpenAI-compatible API, with vLLM's extra sampling fields:
what every generation request shares, /v1/chat/completions, /v1/models, /tokenize, /detokenize
and batch files. /v1/completions' own bodies are in serving/protocol_completion.py, and those
of /v1/embeddings and /pooling in serving/protocol_pooling.py, both built on these.

Unknown request fields are accepted and ignored (logged), as OpenAI clients send new fields
before servers know them; wrong types are refused with 400 by the error handlers. Types are
strict ("stream": "yes", "max_tokens": true and "seed": "1" are mistakes, not values to coerce),
numbers must be finite, and no text may hold a lone UTF-16 surrogate (it cannot be encoded, so
it would fail later, far from the request).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from jaxllm.sampling_params import SamplingParams
from jaxllm.structured_output import from_request
from serving.errors import APIError

_INT64 = 2**63


def random_id() -> str:
    return uuid.uuid4().hex


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _find_surrogate(value: Any) -> bool:
    """Whether any string in a JSON value (keys included) holds a lone surrogate; iterative,
    since a body may nest as deep as the JSON parser allows."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item) is not None:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(v for v in item if not isinstance(v, int))
    return False


class RequestBody(OpenAIModel):
    """A whole request body: its text is checked once for lone surrogates, naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if _find_surrogate(key) or _find_surrogate(value):
                    name = key[:64] if not _find_surrogate(key) else "a field name"
                    raise ValueError(f"{name} contains a lone UTF-16 surrogate, which is not "
                                     f"valid Unicode text")
        return data


class StreamOptions(OpenAIModel):
    include_usage: Optional[bool] = True
    continuous_usage_stats: Optional[bool] = False


class SamplingRequest(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    frequency_penalty: Optional[float] = 0.0
    presence_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    n: int = 1
    seed: Optional[int] = Field(None, ge=-_INT64, lt=_INT64)
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    user: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None
    # vLLM's extras.
    best_of: Optional[int] = None
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search only
    # Whether this endpoint answers use_beam_search (serving/beam_search.py).
    beam_search_supported: ClassVar[bool] = False
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[int] = None
    priority: int = 0
    request_id: Optional[str] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    return_tokens_as_token_ids: Optional[bool] = None
    # vLLM's: SamplingParams.extra_args, for the server's custom logits processors.
    vllm_xargs: Optional[dict[str, Union[str, int, float, list[Union[str, int, float]]]]] = None
    # Structured output in every spelling vLLM has had (response_format above, too); at most
    # one may constrain a request (jaxllm/structured_output/params.py `from_request`).
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None

    def check_supported(self) -> None:
        """Refuse what the engine cannot do, rather than silently ignoring it."""
        if self.stream_options is not None and not self.stream:
            raise APIError("Stream options can only be defined when `stream=True`.",
                           param="stream_options")
        if self.use_beam_search and not self.beam_search_supported:
            raise APIError("Beam search is only supported on /v1/completions.",
                           param="use_beam_search")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of is not supported (vLLM removed it: ask for n completions "
                           "with logprobs and pick by their cumulative logprob); only "
                           "best_of == n is accepted.", param="best_of")
        if self.truncate_prompt_tokens == 0:
            raise APIError("truncate_prompt_tokens must be -1 (max_model_len) or at least 1.",
                           param="truncate_prompt_tokens")

    def structured_output_params(self):
        """The request's constraint (or None); an APIError naming the field if it is invalid,
        unsupported or given twice. A request without any of these fields has none, and does
        not enter structured output at all."""
        body = {name: getattr(self, name) for name in STRUCTURED_FIELDS}
        if all(value is None for value in body.values()):
            return None
        try:
            return from_request(body)
        except ValueError as e:
            field = next((n for n in STRUCTURED_FIELDS if str(e).startswith(n)), None)
            raise APIError(str(e), param=field) from None

    def sampling_params(self, max_tokens: int, logprobs: Optional[int],
                        prompt_logprobs: Optional[int], defaults: dict) -> SamplingParams:
        """SamplingParams (raising ValueError naming the field). Unset fields take `defaults`
        (the model's generation config, as vLLM does), then OpenAI's defaults."""
        def pick(name: str, fallback):
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        return SamplingParams(
            n=self.n,
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=({k: max(-100.0, min(100.0, v)) for k, v in self.logit_bias.items()}
                        if self.logit_bias else None),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.structured_output_params(),
            extra_args=self.vllm_xargs,
        )


STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                      "guided_choice", "guided_grammar", "guided_decoding_backend",
                      "guided_whitespace_pattern")


def _or(value, default):
    return default if value is None else value


# --- usage, in every generation and pooling response -------------------------------------------

class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
    prompt_tokens_details: Optional[dict[str, int]] = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


# --- /v1/chat/completions ----------------------------------------------------------------------

class ContentPart(OpenAIModel):
    type: str
    text: Optional[str] = None


# OpenAI's roles; a template given another may render it as anything, so it is refused.
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessageParam(OpenAIModel):
    role: ChatRole
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = 0
    max_tokens: Optional[int] = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    # vLLM's extras.
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None:
            if self.top_logprobs < 0:
                raise APIError("top_logprobs must be a non-negative value.",
                               param="top_logprobs")
            if self.top_logprobs > 0 and not self.logprobs:
                raise APIError("when using `top_logprobs`, `logprobs` must be set to true.",
                               param="top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError("Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to true.", param="continue_final_message")

    @property
    def requested_max_tokens(self) -> Optional[int]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class ChatMessage(BaseModel):
    role: str
    content: Optional[str] = None
    # vLLM 0.32's name (it dropped `reasoning_content`, the name DeepSeek's API uses).
    reasoning: Optional[str] = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[dict[int, dict[str, Any]]]]] = None


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):  # OpenAI sends the role only in a choice's first delta
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# --- /v1/models, /tokenize, /detokenize -------------------------------------------------------

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxllm"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestBody):
    """Either a `prompt` (completion style) or `messages` (rendered with the chat template)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessageParam]] = None
    add_special_tokens: Optional[bool] = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    return_token_strs: Optional[bool] = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(RequestBody):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# --- LoRA adapters at run time (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) -------

class _LoRAAdapterBody(RequestBody):
    model_config = ConfigDict(extra="forbid")  # an unknown field is refused, naming it


class LoadLoRAAdapterRequest(_LoRAAdapterBody):
    lora_name: str
    lora_path: str
    # vLLM's in-place reload and 3-D weights: refused when set (unload, then load instead).
    load_inplace: Literal[False] = False
    is_3d_lora_weight: Literal[False] = False


class UnloadLoRAAdapterRequest(_LoRAAdapterBody):
    lora_name: str
    lora_int_id: Optional[int] = None  # vLLM's; when given, it must be the adapter's id


# --- OpenAI batch files (jaxllm run-batch) ----------------------------------------------------

class BatchRequestInput(OpenAIModel):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class BatchResponseData(BaseModel):
    status_code: int = 200
    request_id: str
    body: Optional[dict[str, Any]] = None


class BatchRequestOutput(BaseModel):
    id: str
    custom_id: Optional[str]
    response: Optional[BatchResponseData]
    error: Optional[dict[str, Any]]
