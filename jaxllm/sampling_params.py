"""SamplingParams and BeamSearchParams with vLLM's fields, defaults and validation (invalid
values name the field). Both live here, as in vLLM (`vllm.sampling_params.BeamSearchParams`),
so that user code imports them from one host-level module without JAX."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from jaxllm.structured_output.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what each RequestOutput of a request holds. CUMULATIVE: everything so far;
    DELTA: only what is new since the request's previous output; FINAL_ONLY: one output, when
    the request finishes. Names ("delta", "final_only") are accepted as well."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    output_kind: RequestOutputKind = field(default=RequestOutputKind.CUMULATIVE, repr=False)
    # vLLM's: words whose last token is banned whenever the output so far ends with the tokens
    # before it (each word tokenized alone and with a leading space; see update_from_tokenizer).
    bad_words: Optional[list[str]] = None
    # Keep only the last k prompt tokens (-1: max_model_len), applied by the engine.
    truncate_prompt_tokens: Optional[int] = None
    # vLLM 0.32's name; `guided_decoding` is vLLM's older spelling of the same constraint
    # (GuidedDecodingParams is StructuredOutputsParams), accepted and read as an alias.
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_decoding: Optional[StructuredOutputsParams] = field(default=None, repr=False)
    # Arguments for custom logits processors (vLLM's; `vllm_xargs` over HTTP): the engine
    # refuses them when none is configured, each processor's validate_params checks them.
    extra_args: Optional[dict[str, Any]] = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        self._bad_words_token_ids: list[list[int]] = []
        self.output_kind = _output_kind(self.output_kind)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias must map token ids to numbers, got "
                                 f"{self.logit_bias!r}") from None
        self._merge_guided_decoding()
        self._verify()

    def _merge_guided_decoding(self) -> None:
        """Both spellings name one field: after construction both read the same value."""
        so, gd = self.structured_outputs, self.guided_decoding
        if so is not None and gd is not None and so != gd:
            raise ValueError("structured_outputs and guided_decoding (its older name) were both "
                             "given, with different constraints; give only one")
        value = so if so is not None else gd
        if isinstance(value, dict):
            value = StructuredOutputsParams.from_dict(value)
        if value is not None and not isinstance(value, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams "
                             f"(GuidedDecodingParams), got {value!r}")
        self.structured_outputs = self.guided_decoding = value

    def _verify(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}.")

        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words", "must be a list of non-empty strings")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t == 0 or t < -1):
            bad("truncate_prompt_tokens", "must be -1 (max_model_len) or at least 1")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be at least 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "must be greater than zero")
        if not self.temperature >= 0.0:
            bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be 0 or -1 (disable), or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", "must be non-negative")
        if any(not s for s in self.stop):
            bad("stop", "cannot contain an empty string")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            bad("allowed_token_ids", "must not be empty")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if self.extra_args is not None and not (isinstance(self.extra_args, dict) and all(
                isinstance(k, str) for k in self.extra_args)):
            bad("extra_args", "must be a dict with string keys")

    def verify_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids in range, logprob counts within the cap."""
        for name, ids in (("logit_bias", list(self.logit_bias or {})),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("stop_token_ids", self.stop_token_ids),
                          ("bad_words", [t for w in self.bad_words_token_ids for t in w])):
            out = [i for i in ids if not 0 <= i < vocab_size]
            if out:
                raise ValueError(f"{name} has token id(s) {out[:5]} outside the vocabulary "
                                 f"[0, {vocab_size}).")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ValueError(f"Requested {name}={value} is more than the maximum "
                                 f"allowed ({max_logprobs}); raise --max-logprobs.")

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenize bad_words as vLLM does: each word alone, and with a leading space when that
        makes a different token sequence of the same length (the word mid-text)."""
        self._bad_words_token_ids = []
        for word in self.bad_words:
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            self._bad_words_token_ids.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                self._bad_words_token_ids.append(spaced)

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._bad_words_token_ids

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def needs_output_history(self) -> bool:
        """Penalties count the output tokens, bad words match their ends, and a grammar's
        matcher must have taken them all before the next mask: each needs every output token
        on the host before the next step samples."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0 or bool(self.bad_words)
                or self.structured_outputs is not None)

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)


def _output_kind(value) -> RequestOutputKind:
    if isinstance(value, str):
        name = value.upper().replace("-", "_")
        if name in RequestOutputKind.__members__:
            return RequestOutputKind[name]
    elif isinstance(value, int) and value in iter(RequestOutputKind):
        return RequestOutputKind(value)
    raise ValueError(f"output_kind must be one of {[k.name for k in RequestOutputKind]}, "
                     f"got {value!r}.")


@dataclass
class BeamSearchParams:
    """vLLM's: `LLM.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32))`; the
    search itself is jaxllm/entrypoints/beam_search.py."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
