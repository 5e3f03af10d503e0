"""A pipeline stage's model: a `Decoder` of layers [start, end) of the whole model, with its
weights only (the embedding on the first stage, the final norm and LM head on the last; a tied
embedding on both), placed on the stage's sub-mesh.

The stage is a Decoder of a config whose per-layer fields are cut to its layers, so its
`run_layers`, `kv_cache_shapes` and layer groups cover exactly its layers and nothing else
changes: the same code runs a stage and a whole model. Across hosts a host holds data only for
its own stages; another host's stage is made of placeholders (`absent_array`) with the same
shapes and shardings, so both hosts trace and number the same calls.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxllm.models.decoder import Decoder, abstract_decoder
from jaxllm.models.model_config import ModelConfig
from jaxllm.parallel.mesh import absent_array, named_sharding
from jaxllm.parallel.pipeline import is_local


def stage_config(cfg: ModelConfig, start: int, end: int) -> ModelConfig:
    """cfg with layers [start, end) only."""
    return dataclasses.replace(cfg, num_layers=end - start, rope=cfg.rope[start:end],
                               sliding_window=cfg.sliding_window[start:end],
                               moe_layers=cfg.moe_layers[start:end],
                               nope_layers=cfg.nope_layers[start:end],
                               attention_chunk=cfg.attention_chunk[start:end])


def stage_cuts(model: Decoder, start: int, end: int) -> list[tuple[int, int, int]]:
    """Stage group j of the stage running layers [start, end): the model's group i and its
    layers [a, b) within that group, as (i, a, b). Stage group j is the j-th group of the
    model that meets [start, end), cut to it."""
    spans = [(i, g.first, max(start, g.first), min(end, g.first + g.count))
             for i, g in enumerate(model.groups)]
    return [(i, a - first, b - first) for i, first, a, b in spans if a < b]


def stage_lora_share(weights: dict, cuts: list[tuple[int, int, int]]) -> dict:
    """A stage's share of an adapter in slot layout ({(model group, projection): (A [L, ...],
    B [L, ...])}, jaxllm/loader/lora.py): the same, keyed by the stage's groups and cut to
    their layers (`stage_cuts`)."""
    return {(j, proj): (a[lo:hi], b[lo:hi]) for j, (i, lo, hi) in enumerate(cuts)
            for (g, proj), (a, b) in weights.items() if g == i}


def split_stage(model: Decoder, start: int, end: int, mesh: Mesh) -> Decoder:
    """The stage of `model` (logical-layout weights, as loaded) running layers [start, end),
    its weights copied onto `mesh` with the shardings their logical axes give there (or, if
    mesh is another host's, placeholders)."""
    local = is_local(mesh)
    cfg = stage_config(model.cfg, start, end)
    stage = abstract_decoder(cfg, model.backend, first=start == 0,
                             last=end == model.cfg.num_layers)
    cuts = stage_cuts(model, start, end)
    full = dict(nnx.to_flat_state(nnx.state(model)))
    state = nnx.state(stage)
    for path, var in nnx.to_flat_state(state):
        sharding = named_sharding(mesh, var.get_metadata()["out_sharding"], var.shape)
        if path[0] == "layers":
            i, a, b = cuts[int(path[1])]
            whole = full[("layers", i, *path[2:])].get_value()
            if not local:
                var.set_value(absent_array(var.shape, whole.dtype, sharding))
                continue
            value = whole[a:b]
        else:
            value = full[path].get_value()
        assert value.shape == var.shape, (path, value.shape, var.shape)
        var.set_value(jax.device_put(value, sharding) if local
                      else absent_array(var.shape, value.dtype, sharding))
    return nnx.merge(nnx.graphdef(stage), state)


def stage_forward(stage: Decoder, kv_caches, x: jax.Array, positions: jax.Array, md,
                  logits_indices: jax.Array, lora_slots=None):
    """One stage's part of a step. x: token ids [T] (the first stage embeds them) or the
    hidden states [T, E] the stage before handed on. A stage before the last returns its
    hidden states and caches; the last (it has the final norm) returns as the whole model's
    forward does: the rows to sample [len(logits_indices), E], all final hidden states, and
    its caches. lora_slots: each token's adapter slot (int32 [T]) when the model has LoRA
    slots: the same for every stage, which each applies to its own layers' slots."""
    h = stage.embed_tokens(x) if x.ndim == 1 else x
    h, kv_caches = stage.run_layers(h, kv_caches, positions, md, lora_slots=lora_slots)
    if stage.final_norm is None:
        return h, kv_caches
    hidden = stage.apply_final_norm(h)
    return hidden[logits_indices], hidden, kv_caches
