"""Loading a draft model for speculative decoding, and the checks that it fits its target.

The draft is loaded by the project's own loader (a local HF folder or a .gguf file) with the
target's engine config, except what names the target alone (its path, tokenizer, revision,
max_model_len, config overrides, parallelism): `draft_config`. It must speak the target's
language: the tokenizers' vocabularies (token -> id, added tokens included) must be identical,
and the draft's vocab_size may not exceed the target's (a padded target embedding is fine; a
wider draft could propose ids the target cannot score). It must reach the positions the target
speculates at: its maximum length (from its config) must cover the target's max_model_len,
unless the config's own `max_model_len` caps speculation below it (vLLM's meaning: sequences
past it are not speculated). Every refusal is a ConfigError naming --speculative-config.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from jaxllm.config import ConfigError
from jaxllm.engine_config import EngineConfig, LoadConfig
from jaxllm.loader.default_model import resolve_model
from jaxllm.loader.loader import load_model
from jaxllm.models.model_config import ModelConfig
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.tokenizer import get_tokenizer

logger = logging.getLogger("jaxllm")
FLAG = "--speculative-config"


def draft_config(spec: SpeculativeConfig, config: EngineConfig) -> EngineConfig:
    """The target's engine config turned into the draft's: same dtype, attention backend,
    block size and batch limits; its own file, tokenizer and length; one device; no
    speculation of its own."""
    replace = dataclasses.replace
    load = replace(config.load, model=resolve_model(spec.model), tokenizer=None, revision=None,
                   tokenizer_revision=None, use_tqdm_on_load=False,
                   load_format="dummy" if config.load.load_format == "dummy" else "auto")
    model = replace(config.model, max_model_len=None, hf_overrides=None, rope_scaling=None,
                    rope_theta=None, enable_expert_parallel=False, lora=None)
    parallel = replace(config.parallel, tensor_parallel_size=1, pipeline_parallel_size=1,
                       data_parallel_size=1, data_parallel_size_local=1)
    return replace(config, load=load, model=model, parallel=parallel, speculative=None,
                   cache=replace(config.cache, num_gpu_blocks_override=None),
                   lora=None)  # the draft proposes with the base model (as vLLM's)


def load_draft(spec: SpeculativeConfig, draft: EngineConfig, target_load: LoadConfig,
               target: ModelConfig, mesh):
    """(draft Decoder on `mesh`, its ModelConfig, the longest sequence it speculates for).
    `draft` is `draft_config`'s; `target_load` and `target` are the target's."""
    try:
        model, mc = load_model(draft.load, draft.model, mesh)
    except ConfigError as e:
        raise ConfigError(f"{FLAG}: the draft model {spec.model!r}: {e}") from e
    check_vocab(spec, target_load, target, mc)
    return model, mc, speculation_len(spec, target, mc)


def speculation_len(spec: SpeculativeConfig, target: ModelConfig, draft: ModelConfig) -> int:
    """Sequences are speculated while prompt + output + drafts stay within this many tokens:
    the target's max_model_len, or the config's smaller `max_model_len`. Refused when the
    draft model cannot reach it."""
    if spec.max_model_len is not None:
        if spec.max_model_len > draft.max_model_len:
            raise ConfigError(f"{FLAG}: max_model_len={spec.max_model_len} exceeds the draft "
                              f"model's maximum length ({draft.max_model_len})")
        return min(spec.max_model_len, target.max_model_len)
    if draft.max_model_len < target.max_model_len:
        raise ConfigError(
            f"{FLAG}: the draft model {spec.model!r} reaches {draft.max_model_len} tokens, "
            f"less than the target's max_model_len {target.max_model_len}; lower "
            f"--max-model-len, or set the speculative config's max_model_len (at most "
            f"{draft.max_model_len}) to speculate only on sequences shorter than that")
    return target.max_model_len


def check_vocab(spec: SpeculativeConfig, target_load: LoadConfig, target: ModelConfig,
                draft: ModelConfig) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's (see the module
    docstring for what is compared); the target's tokenizer is `target_load`'s."""
    if draft.vocab_size > target.vocab_size:
        raise ConfigError(f"{FLAG}: the draft model's vocab_size {draft.vocab_size} exceeds "
                          f"the target's {target.vocab_size}: it could propose token ids the "
                          "target does not have")
    mine, theirs = _vocab(target_load), _vocab(spec.model)
    if mine is None or theirs is None:
        if draft.vocab_size != target.vocab_size:
            raise ConfigError(f"{FLAG}: the draft model's vocab_size {draft.vocab_size} differs "
                              f"from the target's {target.vocab_size}, and without both "
                              "tokenizers the vocabularies cannot be compared")
        logger.warning("%s: no tokenizer for %s; the draft model's vocabulary is assumed to "
                       "be the target's (equal vocab_size %d)", FLAG,
                       "the target" if mine is None else spec.model, draft.vocab_size)
        return
    if mine != theirs:
        diff = sorted((set(mine.items()) ^ set(theirs.items())), key=lambda x: x[1])[:3]
        raise ConfigError(
            f"{FLAG}: the draft model {spec.model!r} has another tokenizer than the target "
            f"({len(theirs)} vs {len(mine)} tokens; e.g. {diff} differ): a draft must share "
            "the target's vocabulary (token -> id)")


def _vocab(source) -> Optional[dict]:
    """token -> id of a model's tokenizer (LoadConfig or path), None when it has none."""
    try:
        return get_tokenizer(source).get_vocab()
    except OSError:
        return None
