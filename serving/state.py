"""What every endpoint needs: the engine, the served names, the tokenizer and the limits."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from serving.errors import APIError
from serving.metrics import ServerMetrics

logger = logging.getLogger("jaxllm.serving")


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
    log_requests: bool = True
    max_log_len: Optional[int] = None
    # One thread: tokenizing long prompts stays off the event loop, and HF tokenizers are not
    # safe to share between threads.
    _tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenizer"))

    @classmethod
    def from_engine(cls, engine, **kwargs) -> "ServingState":
        args = engine.engine_args
        names = list(args.served_model_name or [args.model])
        return cls(engine=engine, served_model_names=names, model_path=args.model,
                   tokenizer=engine.get_tokenizer(),
                   max_model_len=engine.model_config.max_model_len,
                   vocab_size=engine.model_config.vocab_size, max_logprobs=args.max_logprobs,
                   metrics=ServerMetrics(engine, names[0]),
                   generation_defaults=dict(engine.generation_defaults), **kwargs)

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
        tok = self.require_tokenizer()
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
        if request.model_extra:
            logger.warning("The following fields were present in the request but ignored: %s",
                           sorted(request.model_extra))

    def log_request(self, request_id: str, prompt: Optional[str], token_ids: list[int],
                    params) -> None:
        if not self.log_requests:
            return
        n = self.max_log_len
        shown_prompt = prompt[:n] if (prompt is not None and n is not None) else prompt
        shown_ids = token_ids[:n] if n is not None else token_ids
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                    request_id, shown_prompt, params, shown_ids)

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False)
