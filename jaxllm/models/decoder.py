"""The one decoder-only transformer; Llama 1-3, Mistral, Qwen2/2.5, Qwen3 and Gemma 2/3 are
flags of `ModelConfig`, not copies.

The forward is three stages, so that a pipeline stage can run a range of layers and hand its
hidden states on: `embed_tokens` -> `run_layers` over layers [start, end) -> `apply_final_norm`
(then `compute_logits`). The layers are a sequence of homogeneous groups (`layer_groups`:
dense, mixture-of-experts, or DeepSeek's latent-attention ones), each with its own stacked
weights, its own `lax.scan` and its own KVCache. Every op runs through the model's backend
(`jaxllm.layers.backends`), a static part of the module chosen at start-up.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ConfigError
from jaxllm.layers.attention import AttentionMetadata, KVCache
from jaxllm.layers.backends.base import Backend
from jaxllm.layers.backends.reference import ACTIVATIONS, ReferenceBackend
from jaxllm.layers.lora import lora_batch
from jaxllm.models import gemma4, llama4
from jaxllm.models.dense import DenseLayers
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.mla import MlaLayers, MlaMoeLayers
from jaxllm.models.moe import MoeLayers
from jaxllm.models.params import constant, dummy_weight, rms_norm
from jaxllm.models.gemma3_vision import SiglipTower
from jaxllm.models.qwen2_5_vl import VisionInputs, VisionTower
from jaxllm.models.qwen3_vl import Qwen3VLTower
from jaxllm.models.qwen3_vl_spec import Qwen3VLVisionSpec
from jaxllm.models.vision_spec import Gemma3VisionSpec, deepstack_levels
from jaxllm.models.qwen3_next import (GatedAttnLayers, GatedAttnMoeLayers, GdnLayers,
                                      GdnMoeLayers, state_shapes)
from jaxllm.models.rope import rope_tables

GROUP_KINDS = {"dense": DenseLayers, "moe": MoeLayers, "mla": MlaLayers, "mla_moe": MlaMoeLayers,
               "gdn": GdnLayers, "gdn_moe": GdnMoeLayers, "gated_attn": GatedAttnLayers,
               "gated_attn_moe": GatedAttnMoeLayers, **gemma4.GROUP_KINDS}
MOE_KINDS = ("moe", "mla_moe", "gdn_moe", "gated_attn_moe")
STATE_KINDS = ("gdn", "gdn_moe")  # groups whose cache is per-sequence state (state_shapes)


class LayerGroup(NamedTuple):
    kind: str   # a key of GROUP_KINDS
    first: int  # the group holds layers [first, first + count)
    count: int


def layer_groups(cfg: ModelConfig) -> tuple[LayerGroup, ...]:
    """The model's layers as consecutive homogeneous groups: dense, or mixture-of-experts
    (`cfg.moe_layers`; Qwen MoE models may mix both)."""
    kinds = ["moe" if cfg.moe_layers and cfg.moe_layers[i] else "dense"
             for i in range(cfg.num_layers)]
    if cfg.kv_lora_rank:  # DeepSeek: multi-head latent attention (jaxllm/models/mla.py)
        kinds = ["mla_moe" if k == "moe" else "mla" for k in kinds]
    if cfg.linear_layers:  # Qwen3-Next (jaxllm/models/qwen3_next.py)
        kinds = [("gdn" if linear else "gated_attn") + ("_moe" if k == "moe" else "")
                 for linear, k in zip(cfg.linear_layers, kinds)]
    if cfg.gemma4 is not None:  # a group per run of one layer type (jaxllm/models/gemma4.py)
        kinds = gemma4.group_kinds(cfg)
    groups, first = [], 0
    for i in range(1, cfg.num_layers + 1):
        if i == cfg.num_layers or kinds[i] != kinds[first]:
            groups.append(LayerGroup(kinds[first], first, i - first))
            first = i
    return tuple(groups)


class Decoder(nnx.Module):
    """token ids + positions + paged KV caches -> final hidden states; `compute_logits` ->
    logits. `seed` only picks the initial (dummy) weights; real ones come from the loader.
    A pipeline stage (jaxllm/models/pipeline_stage.py) is a Decoder of its layers only, with
    the embedding if `first` (or `last` with tied embeddings) and the final norm and LM head
    if `last`: a stage holds no weight it does not use."""

    def __init__(self, cfg: ModelConfig, backend: Backend = ReferenceBackend(), seed: int = 0,
                 *, first: bool = True, last: bool = True):
        if cfg.activation not in ACTIVATIONS:
            raise ConfigError(f"activation {cfg.activation!r} is not supported (supported: "
                              f"{', '.join(ACTIVATIONS)})")
        self.cfg = cfg
        self.backend = backend
        self.groups = layer_groups(cfg)
        V, E, dt = cfg.vocab_size, cfg.hidden_size, cfg.jnp_dtype
        self.embed = (dummy_weight(seed, "embed", (V, E), ("vocab", "embed"), dt)
                      if first or (last and cfg.tie_word_embeddings) else None)
        self.layers = nnx.List([GROUP_KINDS[g.kind](cfg, seed, g.count,
                                                    prefix=f"{i}/" if i else "")
                                for i, g in enumerate(self.groups)])
        self.final_norm = constant(1.0 - cfg.norm_offset, (E,), ("embed",), dt) if last else None
        self.lm_head = (None if cfg.tie_word_embeddings or not last
                        else dummy_weight(seed, "lm_head", (V, E), ("vocab", "embed"), dt))
        # A vision-language model's image encoder (its embeddings enter at the first stage).
        tower = (SiglipTower if isinstance(cfg.vision, Gemma3VisionSpec)
                 else Qwen3VLTower if isinstance(cfg.vision, Qwen3VLVisionSpec) else VisionTower)
        self.vision = tower(cfg.vision, seed, dt) if cfg.vision and first else None
        # Gemma 4's per-layer inputs, made from the token ids with the embeddings.
        if cfg.gemma4 is not None and not (first and last):
            raise ConfigError("Gemma 4: pipeline parallelism is not supported (its per-layer "
                              "inputs and KV-shared layers span the stages)")
        self.per_layer_inputs = (gemma4.PerLayerInputs(cfg, seed)
                                 if cfg.gemma4 is not None and cfg.gemma4.per_layer_size
                                 else None)

    def __call__(self, kv_caches: tuple[KVCache, ...], token_ids: jax.Array, positions: jax.Array,
                 md: AttentionMetadata, lora_slots: Optional[jax.Array] = None,
                 mm_embeds: Optional[tuple[jax.Array, jax.Array]] = None
                 ) -> tuple[jax.Array, tuple[KVCache, ...]]:
        """The whole forward: final hidden states [T, E] and the updated caches. lora_slots:
        each token's LoRA adapter slot, int32 [T] (-1: the base model), when the model was
        built with slots (cfg.lora). mm_embeds: (embeddings [T, E], mask bool [T]) of a
        vision-language model's step: the masked tokens (image placeholders) take the given
        embedding instead of their token's (Qwen3-VL: [T, (1 + L) * E], each deepstack level's
        features then added to their hidden states after decoder layer 0, .., L - 1).
        positions: [3, T] with M-RoPE (cfg.mrope_section)."""
        h = self.embed_tokens(token_ids)
        levels = deepstack_levels(self.cfg)
        if mm_embeds is not None:
            E = h.shape[-1]
            h = jnp.where(mm_embeds[1][:, None], mm_embeds[0][:, :E].astype(h.dtype), h)
        if levels and mm_embeds is not None:
            rows, cut = mm_embeds[1][:, None], 0
            for j in range(levels):  # layers [cut, j + 1), then level j's features
                h, kv_caches = self.run_layers(h, kv_caches, positions, md, cut, j + 1,
                                               lora_slots=lora_slots)
                feats = mm_embeds[0][:, (j + 1) * E:(j + 2) * E].astype(h.dtype)
                h, cut = h + jnp.where(rows, feats, jnp.zeros_like(h)), j + 1
            h, kv_caches = self.run_layers(h, kv_caches, positions, md, cut,
                                           lora_slots=lora_slots)
            return self.apply_final_norm(h), kv_caches
        if self.cfg.gemma4 is not None:
            per_layer = (None if self.per_layer_inputs is None
                         else self.per_layer_inputs(self.backend, token_ids, h))
            h, kv_caches = gemma4.run_layers(self, h, kv_caches, positions, md, 0,
                                             self.cfg.num_layers, per_layer)
            return self.apply_final_norm(h), kv_caches
        h, kv_caches = self.run_layers(h, kv_caches, positions, md, lora_slots=lora_slots)
        return self.apply_final_norm(h), kv_caches

    def forward_counting_experts(self, kv_caches: tuple[KVCache, ...], token_ids: jax.Array,
                                 positions: jax.Array, md: AttentionMetadata,
                                 lora_slots: Optional[jax.Array] = None,
                                 mm_embeds: Optional[tuple[jax.Array, jax.Array]] = None
                                 ) -> tuple[jax.Array, tuple[KVCache, ...], jax.Array]:
        """The forward (`__call__`), and the tokens it routed to each expert of each MoE layer,
        padding not counted: int32 [len(moe_layer_ids), experts] (--enable-expert-load-metrics,
        which sets cfg.count_expert_load; the MoE groups sow their counts)."""
        (h, caches), sown = nnx.capture(Decoder.__call__, nnx.Intermediate)(
            self, kv_caches, token_ids, positions, md, lora_slots, mm_embeds)
        loads = [sown["layers"][i]["expert_load"][...]
                 for i, g in enumerate(self.groups) if g.kind in MOE_KINDS]
        return h, caches, jnp.concatenate(loads)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """The model's MoE layers, in the order of `forward_counting_experts`' rows."""
        return tuple(i for g in self.groups if g.kind in MOE_KINDS
                     for i in range(g.first, g.first + g.count))

    @property
    def attention_backend(self) -> str:
        """The backend's name (what start-up picks the KV cache dtype by)."""
        return self.backend.name

    def kv_cache_shapes(self, num_blocks: int, block_size: int, state_slots: int = 0
                        ) -> tuple[tuple, ...]:
        """[layers, num_blocks, kv heads, block_size, head_dim] of each group's cache; for
        multi-head latent attention KVCache(latent shape, empty V shape): one latent "head"
        of kv_lora_rank + qk_rope_head_dim values, which serves as K and V; for a hybrid
        model's linear-attention groups KVCache(conv state, recurrent state) over
        `state_slots` per-sequence slots (jaxllm/models/qwen3_next.py)."""
        c = self.cfg
        if c.gemma4 is not None:
            return gemma4.kv_cache_shapes(c, self.groups, num_blocks, block_size)
        if c.linear_layers:
            return tuple(state_shapes(c, g.count, state_slots) if g.kind in STATE_KINDS
                         else (g.count, num_blocks, c.num_kv_heads, block_size, c.head_dim)
                         for g in self.groups)
        if c.kv_lora_rank:
            return tuple(KVCache((g.count, num_blocks, 1, block_size, c.kv_values_per_token),
                                 (g.count, num_blocks, 1, block_size, 0)) for g in self.groups)
        return tuple((g.count, num_blocks, c.num_kv_heads, block_size, c.head_dim)
                     for g in self.groups)

    def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
        """token ids [T] -> hidden states [T, E] entering layer 0."""
        cfg = self.cfg
        h = self.backend.embed(self.embed[...], token_ids, cfg.hidden_size)
        if cfg.embed_scale is not None:
            h = h * jnp.asarray(cfg.embed_scale, h.dtype)
        return h

    def run_layers(self, h: jax.Array, kv_caches: tuple[KVCache, ...], positions: jax.Array,
                   md: AttentionMetadata, start: int = 0, end: Optional[int] = None,
                   lora_slots: Optional[jax.Array] = None
                   ) -> tuple[jax.Array, tuple[KVCache, ...]]:
        """Hidden states entering layer `start` -> those leaving layer end - 1 (static bounds;
        end None = the last layer). Caches of groups outside the range pass through."""
        cfg = self.cfg
        if cfg.gemma4 is not None:  # its groups run in gemma4.run_layers (from __call__)
            raise ValueError("Gemma 4 runs its layers in jaxllm.models.gemma4.run_layers")
        if (lora_slots is None) != (cfg.lora is None):
            raise ValueError("lora_slots are the step's input exactly when the model has LoRA "
                             "slots (cfg.lora)")
        lora = None if lora_slots is None else lora_batch(lora_slots, cfg.lora.max_loras)
        end = cfg.num_layers if end is None else end
        specs = tuple(dict.fromkeys(cfg.rope))  # distinct RoPE settings (Gemma 3: local/global)
        cos, sin = rope_tables(specs, cfg.head_dim, positions, h.dtype, cfg.mrope_section,
                               cfg.mrope_interleaved)
        windowed = any(cfg.sliding_window)
        caches = list(kv_caches)
        for i, (g, layers) in enumerate(zip(self.groups, self.layers)):
            a, b = max(start, g.first), min(end, g.first + g.count)
            if a >= b:
                continue
            rope_ids = jnp.asarray([specs.index(s) for s in cfg.rope[a:b]], jnp.int32)
            windows = jnp.asarray(cfg.sliding_window[a:b], jnp.int32) if windowed else None
            rope = (cos, sin, rope_ids, windows)
            if cfg.nope_layers:  # Llama 4's per-layer NoPE and attention chunk
                rope += (llama4.layer_inputs(cfg, a, b, positions),)
            h, caches[i] = layers(self.backend, h, caches[i], md, rope, a - g.first,
                                  b - g.first, lora)
        return h, tuple(caches)

    def encode_images(self, patches: jax.Array, inputs: VisionInputs) -> jax.Array:
        """Pixel patches [N, C·t·p·p] of a step's images -> their token embeddings
        [N / merge_unit, E] (jaxllm/models/qwen2_5_vl.py; Qwen3-VL [N / merge_unit, (1 + L) * E]
        with its deepstack levels, jaxllm/models/qwen3_vl.py); Gemma 3: pixels [B, C, S, S] ->
        [B, mm_tokens_per_image, E] (jaxllm/models/gemma3_vision.py, inputs None)."""
        return self.vision(patches, inputs)

    def apply_final_norm(self, h: jax.Array) -> jax.Array:
        return rms_norm(h, self.final_norm[...], self.cfg)

    def _head(self) -> jax.Array:
        return self.embed[...] if self.lm_head is None else self.lm_head[...]

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, E] -> float32 logits [N, V], final soft-capping applied."""
        logits = self.backend.logits(hidden, self._head(), self.cfg.vocab_size)
        if self.cfg.logits_scaling != 1.0:  # Granite; positive, so greedy_head's argmax holds
            logits = logits / self.cfg.logits_scaling
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    @property
    def greedy_head(self) -> Optional[Callable]:
        """hidden [N, E] -> int32 [N], the first maximum of compute_logits(hidden) without the
        logits, where the backend has one; None with soft-capping (its tanh can make ties of
        distinct logits)."""
        if self.cfg.final_logit_softcap is not None:
            return None
        return self.backend.greedy_head(self._head(), self.cfg.vocab_size)


def abstract_decoder(cfg: ModelConfig, backend: Backend = ReferenceBackend(), **stage
                     ) -> Decoder:
    """The module with shapes only (nothing allocated); the loader fills in the weights.
    stage: Decoder's `first`/`last` (a pipeline stage's parts)."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: Decoder(cfg, backend, **stage))


def init_decoder(cfg: ModelConfig, seed: int = 0, backend: Backend = ReferenceBackend(),
                 shardings=None) -> Decoder:
    """Dummy weights (uniform in +-0.05, norms at identity), created directly with `shardings`."""
    def make():
        with nnx.use_eager_sharding(False):
            return nnx.split(Decoder(cfg, backend, seed))[1]

    graphdef = nnx.graphdef(abstract_decoder(cfg, backend))
    return nnx.merge(graphdef, jax.jit(make, out_shardings=shardings)())
