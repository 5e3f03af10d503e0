"""--calculate-kv-scales: each attention layer's (k_scale, v_scale) computed once at start-up.

vLLM computes them from the first forward pass; here that pass is a calibration prefill of a
fixed English text (`CALIBRATION_TEXT`, tokenized with the model's tokenizer; without one, ids
spread over the vocabulary), run before the engine takes requests, so every request sees the
same fixed scales and no step program carries the computation. The prefill runs the model with
a float32 scratch cache and scales of 1.0, so the cache holds each layer's k and v as
attention receives them (after norms and RoPE); a layer's scale is its amax over that cache
divided by the float8 format's largest value (448 for e4m3, 57344 for e5m2): the calibration's
values then just fit. Later values beyond it saturate (the cache's conversion clips).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ConfigError
from jaxllm.layers.attention import AttentionMetadata, KVCache
from jaxllm.layers.backends.reference import ReferenceBackend
from jaxllm.models.decoder import abstract_decoder

logger = logging.getLogger("jaxllm")

CALIBRATION_TEXT = (
    "The history of the city begins with a small settlement on the river, where traders "
    "exchanged salt, grain and cloth. Over three centuries it grew into a busy port: ships "
    "arrived from distant coasts, scholars founded a library, and engineers built bridges, "
    "canals and a great clock tower. Today visitors walk through its markets, ask questions "
    "about the old walls, read poems carved in stone, and count 1, 2, 3 bells at noon. "
    "def area(r):\n    return 3.14159 * r * r\n# {\"name\": \"calibration\", \"value\": 42}")
BLOCK = 16  # tokens per block of the scratch cache


def calibration_ids(tokenizer, vocab_size: int) -> np.ndarray:
    """The calibration prefill's token ids."""
    if tokenizer is not None:
        ids = tokenizer.encode(CALIBRATION_TEXT)
        ids = [i for i in ids if 0 <= i < vocab_size]
        if ids:
            return np.asarray(ids, np.int32)
    return (np.arange(128, dtype=np.int64) * 7919 % vocab_size).astype(np.int32)


def calculate_kv_scales(model, cache_dtype, tokenizer=None,
                        ids: Optional[np.ndarray] = None) -> np.ndarray:
    """Set every layer's kv_scales of `model` (loaded, logical layout) from one calibration
    prefill (`ids`, default `calibration_ids`); returns them, float32 [layers, 2]."""
    cfg = model.cfg
    if ids is None:
        ids = calibration_ids(tokenizer, cfg.vocab_size)
    T = len(ids)
    top = float(jnp.finfo(cache_dtype).max)
    mesh = model.embed[...].sharding.mesh
    # The reference ops read the loaded (logical) layout the model has before the runner
    # relays it out for its own backend.
    multi = None if mesh.size == 1 else mesh.abstract_mesh
    graphdef = nnx.graphdef(abstract_decoder(cfg, ReferenceBackend(multi)))
    state = nnx.state(model)
    groups = [(i, g) for i, g in enumerate(model.groups)]
    for i, _ in groups:  # k and v stored as they are while measuring
        var = state["layers"][i]["kv_scales"]
        var.set_value(jnp.ones_like(var.get_value()))
    blocks = math.ceil(T / BLOCK)
    md = AttentionMetadata(jnp.arange(T, dtype=jnp.int32), jnp.asarray([T], jnp.int32),
                           jnp.arange(blocks, dtype=jnp.int32)[None],
                           jnp.asarray([0, T], jnp.int32), jnp.asarray([1], jnp.int32))
    shapes = model.kv_cache_shapes(blocks, BLOCK)

    @jax.jit
    def amax(state, ids, positions, md):
        caches = tuple(KVCache(jnp.zeros(s, jnp.float32), jnp.zeros(s, jnp.float32))
                       for s in shapes)
        _, caches = nnx.merge(graphdef, state)(caches, ids, positions, md)
        return [jnp.stack([jnp.max(jnp.abs(c.k), axis=(1, 2, 3, 4)),
                           jnp.max(jnp.abs(c.v), axis=(1, 2, 3, 4))], axis=1) for c in caches]

    found = amax(state, jnp.asarray(ids), jnp.arange(T, dtype=jnp.int32), md)
    bad = [(g.first + j, "kv"[c]) for (_, g), a in zip(groups, found)
           for j, c in zip(*np.nonzero(~np.isfinite(np.asarray(a))))]
    if bad:
        raise ConfigError(f"--calculate-kv-scales: the calibration prefill's k/v are not "
                          f"finite in layer {bad[0][0]} ({bad[0][1]}); the weights overflow "
                          f"in {cfg.dtype}?")
    out = []
    for (i, _), a in zip(groups, found):
        # an all-zero layer (e.g. zero weights) keeps a scale that stores zeros exactly
        scales = jnp.maximum(a, jnp.finfo(jnp.float32).tiny * top) / top
        var = state["layers"][i]["kv_scales"]
        var.set_value(jax.device_put(scales.astype(jnp.float32), var.get_value().sharding))
        out.append(np.asarray(scales))
    nnx.update(model, state)
    result = np.concatenate(out)
    logger.info("--calculate-kv-scales: k/v scales from a %d-token calibration prefill: "
                "k %.4g .. %.4g, v %.4g .. %.4g over %d layers", T, result[:, 0].min(),
                result[:, 0].max(), result[:, 1].min(), result[:, 1].max(), len(result))
    return result
