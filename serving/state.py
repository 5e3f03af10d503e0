"""What every endpoint needs: the engine, the served names, the tokenizer and the limits."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from serving.errors import APIError
from serving.limits import Admission, RequestLimits, check_text_length, longest_token_chars
from serving.metrics import ServerMetrics

logger = logging.getLogger("jaxllm.serving")
# vLLM request fields this server has no implementation of yet (and any guided_* field other
# than the ones serving/protocol.py declares).
UNSUPPORTED_VLLM_FIELDS = {"logits_processors", "vllm_xargs", "kv_transfer_params", "cache_salt",
                           "mm_processor_kwargs"}


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
        return cls(engine=engine, served_model_names=names, model_path=args.model,
                   tokenizer=tokenizer, max_model_len=max_model_len,
                   vocab_size=engine.model_config.vocab_size, max_logprobs=args.max_logprobs,
                   metrics=ServerMetrics(engine, names[0]),
                   generation_defaults=dict(engine.generation_defaults), limits=limits,
                   admission=Admission(args.max_num_seqs, limits.max_waiting_requests),
                   **kwargs)

    def model_name(self, requested: Optional[str]) -> str:
        """The name to answer with; an unknown name is a 404 as in OpenAI's API."""
        if requested is None or requested == "":
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise APIError(f"The model `{requested}` does not exist.", 404, param="model")
        return requested

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise APIError("This server was started with --skip-tokenizer-init: send token ids, "
                           "not text.")
        return self.tokenizer

    async def in_tokenizer_thread(self, fn: Callable, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`, refusing first a text too long to fit the context, since the
        tokenizer cannot be interrupted (a 10 MB prompt holds its thread for ~20 s)."""
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
