"""Pooling (embeddings): a prompt's final hidden states -> one vector, beside the generate step.

A pooling request never decodes, so it needs no place in the paged KV cache or the scheduler:
each prompt runs once through the model with a scratch cache just big enough for it, created
inside the program, so the step's cache and programs are untouched. Prompts are padded to a
power-of-two token bucket, so a few programs (compiled on first use) serve every length. The
pooled vector is taken on the host in float32.

How to pool comes from the model, as in vLLM: a sentence-transformers folder says it in
modules.json and 1_Pooling/config.json (CLS, mean or last token; a Normalize module);
otherwise vLLM's default for a decoder LM used for embeddings: the last token, L2-normalized.
--pooler-config overrides either.

A classifier (--convert classify) pools the same way (the last token) and puts the pooled
state through its head (jaxllm/loader/classifier_head.py); its activation is what `normalize`
(use_activation) turns on or off.

An encoder-only model (BERT, RoBERTa: jaxllm/models/bert.py) has no cache at all: its bucket
runs through `BertEncoder.encode`, bidirectionally, with the request's token types (a
cross-encoder's sequence pair: `PoolingParams.type_start`); its default pooling is vLLM's for
it, the first token ([CLS], <s>).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ConfigError
from jaxllm.layers.attention import AttentionMetadata, KVCache
from jaxllm.loader.classifier_head import ClassifierHead
from jaxllm.pooling_params import PoolingParams

# What a request of the other kind gets (by whether it asked to pool): vLLM's messages.
WRONG_RUNNER = {
    True: "Embeddings are only supported for pooling models; this one runs with --runner "
          "generate. Start it with --runner pooling (or --convert embed) to embed.",
    False: "Text generation is only supported for generative models; this one runs with "
           "--runner pooling (embeddings). Start it with --runner generate to generate text.",
}

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
# sentence-transformers' pooling modes -> ours, in the order it checks them.
_ST_MODES = (("pooling_mode_cls_token", "CLS"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_lasttoken", "LAST"))


# --pooler-config keys (vLLM 0.32's, and older ones) -> PoolerConfig fields.
_POOLER_KEYS = {"pooling_type": "pooling_type", "seq_pooling_type": "pooling_type",
                "use_activation": "normalize", "normalize": "normalize"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True


def read_pooler_config(path: str, override: Optional[dict] = None,
                       default_type: str = "LAST") -> PoolerConfig:
    """The model folder's pooling (sentence-transformers files, else vLLM's default:
    `default_type`, CLS for an encoder), with --pooler-config's keys on top: pooling_type (or
    seq_pooling_type) and use_activation (for embeddings, normalize: the key older vLLM
    versions used)."""
    cfg = PoolerConfig(default_type)
    modules = os.path.join(path, "modules.json") if os.path.isdir(path) else ""
    if modules and os.path.exists(modules):
        with open(modules) as f:
            mods = json.load(f)
        kinds = [m.get("type", "") for m in mods]
        pooling = next((m for m in mods if m.get("type", "").endswith(".Pooling")), None)
        ptype = cfg.pooling_type
        if pooling is not None:
            with open(os.path.join(path, pooling.get("path", ""), "config.json")) as f:
                st = json.load(f)
            modes = [ours for key, ours in _ST_MODES if st.get(key)]
            if not modes:
                used = sorted(k for k, v in st.items() if k.startswith("pooling_mode") and v)
                raise ConfigError(f"--model {path}: sentence-transformers pooling {used} is not "
                                  f"supported (supported: cls_token, mean_tokens, lasttoken)")
            ptype = modes[0]
        cfg = PoolerConfig(ptype, any(k.endswith(".Normalize") for k in kinds))
    override = {_POOLER_KEYS.get(k, k): v for k, v in (override or {}).items()}
    unknown = sorted(set(override) - {"pooling_type", "normalize"})
    if unknown:
        raise ConfigError(f"--pooler-config: unsupported key(s) {', '.join(unknown)} "
                          f"(supported: {', '.join(_POOLER_KEYS)})")
    if "pooling_type" in override:
        override["pooling_type"] = str(override["pooling_type"]).upper()
        if override["pooling_type"] not in POOLING_TYPES:
            raise ConfigError(f"--pooler-config: pooling_type must be one of "
                              f"{', '.join(POOLING_TYPES)}")
    if "normalize" in override and not isinstance(override["normalize"], bool):
        raise ConfigError("--pooler-config: use_activation (normalize) must be true or false")
    return replace(cfg, **override)


def pool(hidden: np.ndarray, pooling_type: str, normalize: bool) -> np.ndarray:
    """hidden [n, E] (one prompt) -> [E] (or [n, E] for ALL), L2-normalized as torch's
    F.normalize (eps 1e-12) when asked."""
    out = {"LAST": lambda h: h[-1], "MEAN": lambda h: h.mean(0), "CLS": lambda h: h[0],
           "ALL": lambda h: h}[pooling_type](hidden)
    if normalize:
        out = out / np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out


class Pooler:
    """Final hidden states of one prompt, through the runner's weights and backend, pooled
    as the model's pooling config says (or the request overrides)."""

    def __init__(self, config: PoolerConfig, runner, block_size: int,
                 classifier: Optional[ClassifierHead] = None):
        self.config, self.classifier = config, classifier
        self.graphdef, self.runner, self.block_size = runner.graphdef, runner, block_size
        # Each group's cache shape and dtype, with the block count left to the prompt.
        self.cache_specs = tuple((c.k.shape[:1] + c.k.shape[2:], c.k.dtype)
                                 for c in runner.kv_cache)
        self.encoder = runner.model_config.encoder is not None
        self.token_types = (runner.model_config.encoder.type_vocab_size if self.encoder
                            else 1)
        self._hidden = jax.jit(self._hidden_fn, static_argnums=(4,))
        self._encode = jax.jit(self._encode_fn)

    @property
    def state(self):
        """The runner's weights now (sleep mode and update_weights replace them)."""
        return self.runner.state

    @property
    def tasks(self) -> tuple[str, ...]:
        """The pooling tasks this model serves (vLLM's supported tasks): a classifier's
        classify, and score with one label (a cross-encoder); an embedding model's embed and
        token_embed."""
        if self.classifier is None:
            return ("embed", "token_embed")
        return ("classify", "score") if self.classifier.num_labels == 1 else ("classify",)

    def run(self, token_ids: list[int], params: PoolingParams) -> np.ndarray:
        """The prompt's pooled output: an embedding ([E]; [n, E] per token for task
        token_embed), or a classifier's label probabilities ([num_labels]; task classify,
        or score: the one label's relevance)."""
        task = params.task or self.tasks[0]
        if task not in self.tasks:
            kind = "a classification" if self.classifier is not None else "an embedding"
            raise ValueError(f"task {task!r} is not supported by this model ({kind} model; "
                             f"supported: {', '.join(self.tasks)})")
        activation = (self.config.normalize if params.use_activation is None
                      else params.use_activation)
        start = params.type_start
        if start is not None and start < len(token_ids) and self.token_types < 2:
            raise ValueError("token type ids (extra_kwargs compressed_token_type_ids) are "
                             "only taken by encoder-only models with two token types "
                             "(BERT); this model has " + ("one" if self.encoder else
                                                           "none (a decoder)"))
        hidden = self.hidden_states(token_ids, start)
        if self.classifier is not None:
            hidden = pool(hidden, self.config.pooling_type, False)
            return self.classifier.probs(hidden, activation, score=task == "score")
        ptype = "ALL" if task == "token_embed" else self.config.pooling_type
        return pool(hidden, ptype, activation)

    def _hidden_fn(self, state, token_ids, positions, md, num_blocks: int):
        model = nnx.merge(self.graphdef, state)
        caches = []
        for shape, dtype in self.cache_specs:
            full = (shape[0], num_blocks, *shape[1:])
            caches.append(KVCache(jnp.zeros(full, dtype), jnp.zeros(full, dtype)))
        hidden, _ = model(tuple(caches), token_ids, positions, md)
        return hidden

    def _encode_fn(self, state, token_ids, num_tokens, type_start):
        return nnx.merge(self.graphdef, state).encode(token_ids, num_tokens, type_start)

    def hidden_states(self, token_ids: list[int], type_start: Optional[int] = None
                      ) -> np.ndarray:
        """float32 [len(token_ids), E]: the final (normed) hidden state of every position.
        type_start: an encoder's segment 1 start (None: one segment)."""
        n, bs = len(token_ids), self.block_size
        T = max(16, bs, 1 << (n - 1).bit_length())  # powers of two: a multiple of bs
        ids = np.zeros(T, np.int32)
        ids[:n] = token_ids
        if self.encoder:
            start = np.int32(n if type_start is None else min(type_start, n))
            hidden = self._encode(self.state, ids, np.int32(n), start)
            return np.asarray(jax.device_get(hidden[:n]), np.float32)
        slots = np.arange(T, dtype=np.int32)
        slots[n:] = -1
        md = AttentionMetadata(slots, np.array([n], np.int32),
                               np.arange(T // bs, dtype=np.int32)[None],
                               np.array([0, n], np.int32), np.array([1], np.int32))
        hidden = self._hidden(self.state, ids, np.arange(T, dtype=np.int32), md, T // bs)
        return np.asarray(jax.device_get(hidden[:n]), np.float32)
