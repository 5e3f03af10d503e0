"""From what a caller sends to what the engine runs: a prompt (text, token ids or a vLLM
prompt dict) and its parameters, checked once, with errors that name the field.

Tokenizing, truncation (truncate_prompt_tokens), vocabulary and length checks, the default
max_tokens (what the context leaves), the parameters checked against the model, the grammar
compiled, and each of the n sequences' seed. `LLM`, the server and the data-parallel engine
(which tokenizes once to route) all come through here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from jaxllm.engine.grammar import Grammars
from jaxllm.engine.multimodal import image_processor
from jaxllm.layers.sampling_tensors import EXTRA_PENALTY_IDS
from jaxllm.lora.request import LoRARequest
from jaxllm.sampling_params import SamplingParams
from jaxllm.sequence import ImageInputs

PromptType = Union[str, list[int], dict]


@dataclass(frozen=True)
class EngineRequest:
    """A checked request, ready to fan out into its n sequences."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams  # the engine's own copy, max_tokens filled in
    seeds: tuple[int, ...]  # one per sequence
    eos_token_ids: frozenset
    grammar: Any = None     # a compiled grammar, its matcher made per sequence
    priority: int = 0
    arrival_time: float = 0.0
    lora_request: Optional[LoRARequest] = None
    mm: Optional[ImageInputs] = None  # the prompt's images (vision-language models)


class InputProcessor:
    @classmethod
    def from_config(cls, config, model_config, tokenizer, eos_token_ids: frozenset,
                    runner) -> "InputProcessor":
        """The engine's input processor: `config` the EngineConfig; `runner` says whether its
        backend can take images and how many tokens a step holds."""
        sc = config.scheduler
        return cls(tokenizer, model_config, max_logprobs=sc.max_logprobs,
                   eos_token_ids=eos_token_ids, structured_outputs=config.structured_outputs,
                   priority_scheduling=sc.policy == "priority", seed=config.model.seed,
                   images=image_processor(config, model_config, tokenizer,
                                          refusal=runner.image_refusal,
                                          max_step_tokens=runner.max_num_batched_tokens))

    def __init__(self, tokenizer, model_config, *, max_logprobs: int, eos_token_ids: frozenset,
                 structured_outputs: Optional[dict] = None, priority_scheduling: bool = False,
                 seed: int = 0, images=None):
        """structured_outputs: --structured-outputs-config (the grammar backend's defaults).
        images: a vision-language model's ImageProcessor (jaxllm/engine/multimodal.py)."""
        self.images = images
        self.architecture = model_config.architecture
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_model_len = model_config.max_model_len
        self.max_logprobs = max_logprobs
        self.eos_token_ids = eos_token_ids
        self.grammars = Grammars(tokenizer, model_config.vocab_size, eos_token_ids,
                                 structured_outputs)
        self.priority_scheduling = priority_scheduling
        self._rng = np.random.default_rng(seed)

    def process_prompt(self, prompt: PromptType, truncate_prompt_tokens: Optional[int] = None
                       ) -> tuple[Optional[str], list[int]]:
        """Text and token ids of a prompt given as text, token ids, or a vLLM prompt dict;
        truncate_prompt_tokens=k keeps its last k tokens (-1: max_model_len), as vLLM."""
        text, ids, _ = self._prompt(prompt, truncate_prompt_tokens)
        return text, ids

    def _prompt(self, prompt: PromptType, truncate_prompt_tokens: Optional[int]
                ) -> tuple[Optional[str], list[int], Optional[ImageInputs]]:
        text, ids, mm = None, None, None
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            text = prompt.get("prompt")
            if ids is None and text is None:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text = prompt
        else:
            ids = prompt
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set); "
                                 "pass prompt_token_ids")
            ids = self.tokenizer.encode(text)
        ids = [int(i) for i in ids]
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            if self.images is None:
                raise ValueError(f"multi_modal_data: this model ({self.architecture}) takes "
                                 "no images (a text-only architecture, or a multimodal "
                                 "checkpoint served text-only)")
            if truncate_prompt_tokens is not None:
                raise ValueError("truncate_prompt_tokens is not supported with images (it "
                                 "could cut an image's tokens)")
            ids, mm = self.images.expand(ids, self.images.images_of(prompt["multi_modal_data"]))
        limit = self.max_model_len
        keep = limit if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
            text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
        if not ids:
            raise ValueError("The prompt cannot be empty.")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (size {self.vocab_size}).")
        if len(ids) > limit:
            raise ValueError(f"The prompt (length {len(ids)}) is longer than the maximum model "
                             f"length of {limit}. Make it shorter, or raise --max-model-len.")
        return text, ids, mm

    def process(self, request_id: str, prompt: PromptType,
                params: Optional[SamplingParams] = None, priority: int = 0,
                arrival_time: Optional[float] = None,
                lora_request: Optional[LoRARequest] = None) -> EngineRequest:
        """lora_request: checked by the engine (its adapter registered) before this."""
        params = params.clone() if params is not None else SamplingParams()
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer (skip_tokenizer_init is set)")
            params.update_from_tokenizer(self.tokenizer)
        params.verify_for_model(self.vocab_size, self.max_logprobs)
        grammar = (self.grammars.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        extra = len(params.logit_bias or {}) + len(params.stop_token_ids) + len(self.eos_token_ids)
        if extra > EXTRA_PENALTY_IDS:
            raise ValueError(f"logit_bias and stop_token_ids name {extra} tokens; at most "
                             f"{EXTRA_PENALTY_IDS} are supported.")
        text, ids, mm = self._prompt(prompt, params.truncate_prompt_tokens)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        if not self.priority_scheduling and priority != 0:
            raise ValueError("priority is only used with --scheduling-policy priority")
        seeds = tuple(params.seed + i if params.seed is not None
                      else int(self._rng.integers(2**31 - 1)) for i in range(params.n))
        return EngineRequest(request_id, text, ids, params, seeds, self.eos_token_ids, grammar,
                             priority, time.monotonic() if arrival_time is None else arrival_time,
                             lora_request, mm)
