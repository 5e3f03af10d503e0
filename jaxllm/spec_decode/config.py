"""`--speculative-config`: vLLM's JSON object parsed into a frozen dataclass.

vLLM's `SpeculativeConfig` has many fields; this file accepts the ones jaxllm honours, refuses
the ones it knows but does not support with a ValueError naming the field and why, and refuses
any other key as unknown, so no field is silently ignored. Host-only: no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from jaxllm.json_object import json_object

# vLLM's default n-gram window when neither bound is given.
_DEFAULT_LOOKUP = 5

# Fields of vLLM's SpeculativeConfig that jaxllm refuses, with the reason given to the user.
_UNSUPPORTED = {
    "draft_tensor_parallel_size": "the draft model runs unsharded",
    "tensor_parallel_size": "the draft model runs unsharded",
    "quantization": "the draft model is loaded as the target is (its own file decides)",
    "revision": "models are local files; there is no hub revision",
    "code_revision": "models are local files; there is no hub revision",
    "speculative_token_tree": "tree speculation is not implemented",
    "disable_padded_drafter_batch": "only the padded drafter batch exists",
    "enforce_eager": "every step is jitted",
    "target_model_config": "set internally by vLLM, never by users",
    "target_parallel_config": "set internally by vLLM, never by users",
    "draft_model_config": "set internally by vLLM, never by users",
    "draft_parallel_config": "set internally by vLLM, never by users",
}
# vLLM's methods that jaxllm does not implement.
_UNSUPPORTED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "ernie_mtp",
                        "qwen3_next_mtp", "mimo_mtp", "longcat_flash_mtp", "suffix")
# The target's own multi-token-prediction layer drafts (jaxllm/spec_decode/mtp.py); vLLM's
# name, and its generic synonym.
MTP_METHODS = ("deepseek_mtp", "mtp")
METHODS = ("ngram", "draft_model") + MTP_METHODS


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram": prompt lookup over the request's own tokens (n from prompt_lookup_max
    down to prompt_lookup_min); method "draft_model": `model` proposes; "deepseek_mtp" (or
    "mtp"): the target checkpoint's MTP layer proposes (no `model`). num_speculative_tokens
    (K) drafts per request and step; disable_by_batch_size: no speculation while that many or
    more requests run (vLLM's switch-off when verification stops paying)."""
    method: str
    num_speculative_tokens: int
    model: Optional[str] = None
    prompt_lookup_max: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    max_model_len: Optional[int] = None
    disable_by_batch_size: Optional[int] = None

    @classmethod
    def parse(cls, value: Union[str, dict[str, Any], None]) -> Optional["SpeculativeConfig"]:
        """A JSON string or a dict (the `LLM(speculative_config=...)` keyword) -> config, or
        None for None / an empty object. Every problem raises ValueError naming the field."""
        value = json_object(value, "speculative_config")
        if not value:
            return None
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in value:
            if key in _UNSUPPORTED:
                raise ValueError(f"speculative_config field {key!r} is not supported: "
                                 f"{_UNSUPPORTED[key]}")
            if key not in fields:
                raise ValueError(f"speculative_config has unknown field {key!r} "
                                 f"(known: {', '.join(sorted(fields))})")
        v = dict(value)
        v.setdefault("num_speculative_tokens", None)  # required: refused by name below
        v["method"] = _method(v.get("method"), v.get("model"))
        if v.get("model") in ("ngram", "[ngram]"):
            del v["model"]  # vLLM's spelling {"model": "ngram"} names the method
        return cls(**v)

    def __post_init__(self):
        def integer(name, lo, required=False):
            x = getattr(self, name)
            if x is None and not required:
                return
            if isinstance(x, bool) or not isinstance(x, int) or x < lo:
                raise ValueError(f"speculative_config field {name!r} must be an integer "
                                 f">= {lo}, got {x!r}")

        integer("num_speculative_tokens", 1, required=True)
        for name in ("prompt_lookup_max", "prompt_lookup_min", "max_model_len"):
            integer(name, 1)
        integer("disable_by_batch_size", 2)  # as vLLM: a threshold below 2 is refused
        if self.method not in METHODS:
            raise ValueError(f"speculative_config field 'method' must be one of {METHODS}, "
                             f"got {self.method!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config field 'model' is not used by method "
                                 "'ngram'")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (lo or hi or _DEFAULT_LOOKUP), (hi or lo or _DEFAULT_LOOKUP)
            if lo > hi:
                raise ValueError(f"speculative_config field 'prompt_lookup_min' ({lo}) must "
                                 f"be <= 'prompt_lookup_max' ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif self.method in MTP_METHODS:
            for name in ("model", "prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config field {name!r} is not used by method "
                                     f"{self.method!r} (the target model's own MTP layer "
                                     "drafts)")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config field 'model' (the draft model's path) "
                                 "is required for method 'draft_model'")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config field {name!r} applies only to "
                                     f"method 'ngram'")


def _method(method, model) -> str:
    """vLLM infers the method when it is absent: "ngram" (or "[ngram]") as the model name
    means n-gram, any other model a draft model."""
    if method is None:
        if model in ("ngram", "[ngram]"):
            return "ngram"
        if model is None:
            raise ValueError("speculative_config needs 'method' (one of "
                             f"{METHODS}) or 'model'")
        return "draft_model"
    if method in _UNSUPPORTED_METHODS:
        raise ValueError(f"speculative_config field 'method' {method!r} is not supported "
                         f"(supported: {METHODS})")
    return method
