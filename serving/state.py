"""What every endpoint shares: the engine, the served names, the tokenizer, and the bounds and
admission control that keep one request from hurting the others.

A request may ask for work out of all proportion to its size (`"n": 2**63`, ten thousand stop
strings, a 10 MB prompt for a 2k-token model): such requests are refused with a 400 naming the
field before any of that work starts. Admission caps the sequences waiting for the engine, so an
overloaded server answers 503 with Retry-After at once instead of minutes late. Both live here
because the state holds and applies them: `RequestLimits` and `Admission` are its fields,
`from_engine` derives the prompt-length cap from the tokenizer, and `encode` refuses a text too
long for the context before the tokenizer sees it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from jaxllm.entrypoints.media import MediaPolicy
from serving.errors import APIError
from serving.lora_adapters import LoRAAdapters
from serving.metrics import ServerMetrics

RESPONSES_STORED = 1024  # /v1/responses kept for previous_response_id and GET

logger = logging.getLogger("jaxllm.serving")
# vLLM request fields this server has no implementation of yet (and any guided_* field other
# than the ones serving/protocol.py declares).
UNSUPPORTED_VLLM_FIELDS = {"logits_processors", "kv_transfer_params", "cache_salt",
                           "mm_processor_kwargs"}
RETRY_AFTER_SECONDS = 1


@dataclass
class RequestLimits:
    max_n_sequences: int = 256      # sequences one request may start: n x number of prompts
    max_stop_strings: int = 64
    max_logit_bias: int = 1024
    # Characters a text may have and still fit the context: max_model_len x the longest token.
    # None: no tokenizer (token-id prompts only).
    max_prompt_chars: Optional[int] = None
    chat_template_timeout: float = 2.0  # seconds a chat template may render
    trust_request_chat_template: bool = False
    # Sequences admitted beyond what the engine runs at once (--max-num-seqs); None: no cap.
    max_waiting_requests: Optional[int] = None


def longest_token_chars(tokenizer) -> int:
    """The most characters one token can stand for, from the vocabulary's token strings.

    A byte-level token string has one character per byte and a SentencePiece piece one per
    character ('<0x0A>' byte tokens have more), so a text of C characters needs at least
    C / this many tokens: longer texts cannot fit the context and are refused before the
    (uninterruptible) tokenizer sees them."""
    return max(map(len, tokenizer.get_vocab()), default=1) or 1


def check_request_limits(limits: RequestLimits, req, num_prompts: int = 1) -> None:
    """The bounds every generation request must respect (400s naming the field)."""
    n = req.n
    if n > limits.max_n_sequences:
        raise APIError(f"n={n} is more than the {limits.max_n_sequences} sequences this server "
                       f"allows per request (--max-n-sequences).", param="n")
    if n * num_prompts > limits.max_n_sequences:
        raise APIError(f"{num_prompts} prompts x n={n} is more than the "
                       f"{limits.max_n_sequences} sequences this server allows per request "
                       f"(--max-n-sequences).", param="prompt")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise APIError(f"{len(stops)} stop strings is more than the {limits.max_stop_strings} "
                       f"this server allows (--max-stop-strings).", param="stop")
    cap = limits.max_prompt_chars
    if cap is not None and any(len(s) > cap for s in stops):
        raise APIError(f"A stop string is longer than any text this model can generate "
                       f"({cap} characters).", param="stop")
    if req.logit_bias and len(req.logit_bias) > limits.max_logit_bias:
        raise APIError(f"{len(req.logit_bias)} logit_bias entries is more than the "
                       f"{limits.max_logit_bias} this server allows (--max-logit-bias).",
                       param="logit_bias")


def check_text_length(limits: RequestLimits, text: str, max_model_len: int) -> None:
    cap = limits.max_prompt_chars
    if cap is not None and len(text) > cap:
        at_least = len(text) * max_model_len // cap
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, your request has at least {at_least} input tokens "
                       f"({len(text)} characters). Please reduce the length of the input.",
                       param="prompt")


class Admission:
    """Counts the engine sequences of requests in flight; refuses more than the engine runs
    at once plus `max_waiting` with a 503 (Retry-After), so a flood queues nowhere."""

    def __init__(self, running_capacity: int, max_waiting: Optional[int]):
        self.capacity = None if max_waiting is None else running_capacity + max_waiting
        self.in_flight = 0
        self.lock = threading.Lock()  # a dropped ticket may be collected on another thread

    def enter(self, sequences: int) -> "Ticket":
        with self.lock:
            if self.capacity is not None and self.in_flight + sequences > self.capacity:
                raise APIError(f"The server is overloaded ({self.in_flight} sequences in "
                               f"flight, at most {self.capacity}); retry later.", 503,
                               headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            self.in_flight += sequences
        return Ticket(self, sequences)


class Ticket:
    """Admitted sequences, given back once: by `release()`, or when the ticket is dropped
    (a response stream that was never started still frees its place)."""

    def __init__(self, admission: Admission, sequences: int):
        self.admission, self.sequences = admission, sequences

    def release(self) -> None:
        with self.admission.lock:
            self.admission.in_flight -= self.sequences
            self.sequences = 0

    __del__ = release


class ResponseStore:
    """The last `size` stored responses and their conversations (least recently used out)."""

    def __init__(self, size: int = RESPONSES_STORED):
        self.size = size
        self.items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, messages: list[dict]) -> None:
        self.items[response["id"]] = (response, messages)
        self.items.move_to_end(response["id"])
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: Optional[str] = None) -> tuple[dict, list[dict]]:
        if response_id not in self.items:
            raise APIError(f"Response with id '{response_id}' not found.", 404, param=param)
        self.items.move_to_end(response_id)
        return self.items[response_id]


@dataclass
class ServingState:
    engine: Any
    served_model_names: list[str]
    model_path: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    metrics: ServerMetrics
    # The model's generation-config sampling defaults (temperature, top_p, ..., max_new_tokens).
    generation_defaults: dict = field(default_factory=dict)
    chat_template: Optional[str] = None
    response_role: str = "assistant"
    # Tool calling and reasoning output (serving/cli_args.py add_chat_output_args).
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    exclude_tools_when_tool_choice_none: bool = False
    chat_template_content_format: str = "auto"
    log_requests: bool = False
    max_log_len: Optional[int] = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    admission: Admission = field(default_factory=lambda: Admission(0, None))
    # LoRA adapters served under their own names (--lora-modules, /v1/load_lora_adapter).
    lora: Optional[LoRAAdapters] = None
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses
    # A vision-language model's image processor (jaxllm/engine/multimodal.py; None: text
    # only), and where images may come from (--allowed-local-media-path, ...).
    images: Any = None
    media: MediaPolicy = field(default_factory=MediaPolicy)
    # One thread: tokenizing long prompts stays off the event loop, and HF tokenizers are not
    # safe to share between threads.
    _tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenizer"))

    @classmethod
    def from_engine(cls, engine, limits: Optional[RequestLimits] = None,
                    **kwargs) -> "ServingState":
        """The state of a server on `engine`; `limits` get their derived fields filled in."""
        args = engine.engine_args
        names = list(args.served_model_name or [args.model])
        tokenizer = engine.get_tokenizer()
        max_model_len = engine.model_config.max_model_len
        limits = limits or RequestLimits()
        if tokenizer is not None:
            limits.max_prompt_chars = max_model_len * longest_token_chars(tokenizer)
        kwargs.setdefault("lora", LoRAAdapters(names))
        kwargs.setdefault("images", getattr(getattr(getattr(engine, "engine", None), "input_processor", None),
                                            "images", None))
        return cls(engine=engine, served_model_names=names, model_path=args.model,
                   tokenizer=tokenizer, max_model_len=max_model_len,
                   vocab_size=engine.model_config.vocab_size, max_logprobs=args.max_logprobs,
                   metrics=ServerMetrics(engine, names[0]),
                   generation_defaults=dict(engine.generation_defaults), limits=limits,
                   admission=Admission(args.max_num_seqs, limits.max_waiting_requests),
                   **kwargs)

    def model_name(self, requested: Optional[str], adapters: bool = True) -> str:
        """The name to answer with: a served model's or (unless `adapters` is False: a route
        that cannot run one says so with a 400) a LoRA adapter's; an unknown name is a 404 as
        in OpenAI's API."""
        if requested is None or requested == "":
            return self.served_model_names[0]
        if requested in self.served_model_names:
            return requested
        if self.lora_request(requested) is not None:
            if not adapters:
                raise APIError(f"The model `{requested}` is a LoRA adapter, which this route "
                               f"cannot run; use a base model "
                               f"({', '.join(self.served_model_names)}).", param="model")
            return requested
        raise APIError(f"The model `{requested}` does not exist.", 404, param="model")

    def lora_request(self, name: Optional[str]):
        """The LoRARequest of the adapter served as `name`; None for a base model (answered
        here, without a lookup in the adapters' table)."""
        if self.lora is None or not name or name in self.served_model_names:
            return None
        return self.lora.get(name)

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise APIError("This server was started with --skip-tokenizer-init: send token ids, "
                           "not text.")
        return self.tokenizer

    async def in_tokenizer_thread(self, fn: Callable, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`, refusing first a text too long to fit the context: the
        tokenizer cannot be interrupted, and its one thread serves every text request, so an
        oversized prompt would hold up all the others for as long as it takes (about a second
        per megabyte; docs/performance.md)."""
        tok = self.require_tokenizer()
        check_text_length(self.limits, text, self.max_model_len)
        return await self.in_tokenizer_thread(tok.encode, text,
                                              add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.require_tokenizer().decode(token_ids)

    def token_str(self, token_id: int, decoded: Optional[str]) -> str:
        """A token's text for logprobs: the engine's decoding, else the tokenizer's."""
        if decoded is not None:
            return decoded
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    @staticmethod
    def warn_ignored_fields(request) -> None:
        """Unknown fields are logged (at most 20 names); vLLM fields we cannot honour yet are
        refused, so a client relying on them learns it."""
        extra = sorted(request.model_extra or ())
        refused = [name for name in extra if name in UNSUPPORTED_VLLM_FIELDS
                   or name.startswith("guided_")]
        if refused:
            raise APIError(f"{refused[0]} is not supported by this server.", param=refused[0])
        if extra:
            logger.warning("The following fields were present in the request but ignored: %s%s",
                           [name[:64] for name in extra[:20]],
                           f" and {len(extra) - 20} more" if len(extra) > 20 else "")

    def log_request(self, request_id: str, prompt: Optional[str], token_ids: list[int],
                    params) -> None:
        """With --enable-log-requests: the id and parameters at INFO, the prompt only at
        DEBUG (as vLLM); every value clipped to --max-log-len characters or ids."""
        if not self.log_requests:
            return
        n = self.max_log_len
        logger.info("Received request %s: params: %s", request_id, _clip(str(params), n))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Request %s: prompt: %r, prompt_token_ids: %s", request_id,
                         _clip(prompt, n), token_ids[:n] if n is not None else token_ids)

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False)


def _clip(text: Optional[str], n: Optional[int]) -> Optional[str]:
    if text is None or n is None or len(text) <= n:
        return text
    return f"{text[:n]}...({len(text) - n} more characters)"
