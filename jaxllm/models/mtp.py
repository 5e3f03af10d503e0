"""A checkpoint's multi-token-prediction (MTP) layer as a drafter (DeepSeek-V3's paper, §2.2;
vLLM's deepseek_mtp.py / glm4_moe_mtp.py for the layout): DeepSeek-V3 and GLM-4.5 ship it as
`model.layers.{num_hidden_layers}`.

For a token at position p it reads the target's final (normed) hidden state h_p and the
embedding of the *next* token t_{p+1}, and predicts t_{p+2}:

    x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])      (vLLM zeroes the embedding at p = 0)
    x = decoder layer (the checkpoint's kind: MLA + MoE for DeepSeek-V3) at position p
    logits = head(shared_head.norm(x))

The layer keeps its own paged KV cache (one layer of the target's layout). The embedding and
the LM head are the target's unless the checkpoint carries its own copies (`embed_tokens`,
`shared_head.head` under the MTP layer's prefix, as vLLM reads them): `MtpLayer` holds only the
copies it has, and takes the target `Decoder` for the others. Drafting k > 1 tokens feeds the
layer its own output x as the next position's hidden state (vLLM reuses its one MTP layer so).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.layers.attention import AttentionMetadata, KVCache
from jaxllm.layers.backends.base import Backend
from jaxllm.layers.backends.reference import ReferenceBackend
from jaxllm.models.decoder import Decoder
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.params import constant, dummy_weight, rms_norm


def mtp_config(target: ModelConfig, moe: bool) -> ModelConfig:
    """The target's config cut to the one MTP decoder layer (a MoE layer if `moe`), its own
    embedding and head untied."""
    return dataclasses.replace(
        target, num_layers=1, rope=target.rope[-1:], sliding_window=(0,),
        moe_layers=(moe,) if target.moe_layers else (), tie_word_embeddings=False,
        count_expert_load=False, lora=None)


class MtpLayer(Decoder):
    """The MTP layer of `cfg` (`mtp_config`'s). own_embed / own_head: the checkpoint carries
    its own embedding / LM head (else the target's are used)."""

    def __init__(self, cfg: ModelConfig, backend: Backend = ReferenceBackend(), seed: int = 0,
                 *, own_embed: bool = False, own_head: bool = False):
        super().__init__(cfg, backend, seed)
        if not own_embed:
            self.embed = None
        if not own_head:
            self.lm_head = None
        E, dt = cfg.hidden_size, cfg.jnp_dtype
        self.enorm = constant(1.0, (E,), ("embed",), dt)
        self.hnorm = constant(1.0, (E,), ("embed",), dt)
        self.eh_proj = dummy_weight(seed, "mtp/eh_proj", (2 * E, E), (None, "embed"), dt)

    def hidden_states(self, kv_caches: tuple[KVCache, ...], token_ids: jax.Array,
                      prev_hidden: jax.Array, positions: jax.Array, md: AttentionMetadata,
                      target: Decoder) -> tuple[jax.Array, tuple[KVCache, ...]]:
        """Rows of (next token [T], the hidden state before it [T, E]) at `positions` -> the
        layer's output x [T, E] (before shared_head.norm) and its updated cache."""
        w = self.backend.weight
        e = (self if self.embed is not None else target).embed_tokens(token_ids)
        e = jnp.where((positions == 0)[:, None], jnp.zeros_like(e), e)
        x = jnp.concatenate([rms_norm(e, w(self.enorm[...]), self.cfg),
                             rms_norm(prev_hidden.astype(e.dtype), w(self.hnorm[...]),
                                      self.cfg)], axis=-1)
        x = jnp.einsum("te,ef->tf", x, w(self.eh_proj[...]).astype(x.dtype),
                       preferred_element_type=jnp.float32).astype(e.dtype)
        return self.run_layers(x, kv_caches, positions, md)

    def greedy(self, x: jax.Array, target: Decoder) -> jax.Array:
        """The drafted tokens of the layer's outputs x [N, E]: int32 [N], the first maximum
        of the logits (of its own head, or the target's)."""
        head = self if self.lm_head is not None else target
        h = self.apply_final_norm(x)  # shared_head.norm
        fast = head.greedy_head
        if fast is not None:
            return fast(h).astype(jnp.int32)
        return jnp.argmax(head.compute_logits(h), axis=-1).astype(jnp.int32)
