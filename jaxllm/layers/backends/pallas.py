"""The Pallas backend: the ragged paged attention kernel and the gated DeltaNet kernels of the
platform the program is lowered for (Mosaic on TPU, Triton on GPU), and on TPU jax's megablox
grouped matmul for the MoE experts (`ragged_dot` elsewhere); every other op as the reference
(XLA fuses them well there).

The kernel variant is picked per lowering platform (`lax.platform_dependent`), not from the
host's default backend, so a program exported for TPU or CUDA from a CPU host holds that
platform's kernel. On CPU the GPU variant runs in interpret mode (tests).
On a mesh that shards the KV heads the kernel runs per shard under `shard_map` (XLA cannot
partition a Mosaic call; each shard attends with its own heads, no collective needed); KV
heads that do not divide over the mesh (Gemma 4's full layers) are replicated, and each
device runs the whole kernel under `shard_map`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu.megablox import gmm
from jax.sharding import PartitionSpec as P

from jaxllm.layers.attention import AttentionMetadata, KVCache
from jaxllm.layers.backends.reference import ReferenceBackend, quantized_grouped_matmul
from jaxllm.layers.experts import ragged_dot
from jaxllm.layers.quantization import QuantizedWeight
from pallas_kernels.grouped_matmul import kernel_mxfp4
from pallas_kernels.gated_delta_rule import ops as gdn_ops
from pallas_kernels.ragged_paged_attention import kernel
from pallas_kernels.ragged_paged_mla.reference import write_latent


@dataclasses.dataclass(frozen=True)
class PallasBackend(ReferenceBackend):
    name: ClassVar[str] = "pallas"

    def moe_impl(self, tokens, top_k, experts, dtype):
        return "ragged"  # whatever the host: the program is for the platform it lowers to

    def grouped_matmul(self, lhs, rhs, group_sizes):
        """megablox `gmm` on TPU, `ragged_dot` on others (CPU: the same sum, for tests);
        MXFP4 experts in the MXFP4 grouped matmul kernel on TPU and GPU (decoded per tile in
        the kernel), the XLA one elsewhere."""
        if isinstance(rhs, QuantizedWeight):
            def variant(name):
                return lambda x, q, s, g: kernel_mxfp4.grouped_matmul(x, q, s, g, variant=name)
            return lax.platform_dependent(
                lhs, rhs.q, rhs.scale, group_sizes, tpu=variant("tpu"), cuda=variant("gpu"),
                rocm=variant("gpu"),
                default=lambda x, q, s, g: quantized_grouped_matmul(x, QuantizedWeight(q, s), g))
        return lax.platform_dependent(lhs, rhs, group_sizes, tpu=megablox_gmm,
                                      default=ragged_dot)

    def attend(self, q, kc, vc, layer, md: AttentionMetadata, *, sliding_window=None, **kw):
        if md.attend_to is not None:  # start-up refuses it first (jaxllm/worker/model_runner.py)
            raise NotImplementedError("the Pallas attention kernel is causal only: "
                                      "bidirectional image tokens (attend_to) need another "
                                      "backend")
        sinks = kw.pop("sinks", None)  # an argument, so that shard_map splits it over heads
        chunk = kw.pop("attention_chunk", None)
        k_scale, v_scale = kw.pop("k_scale", None), kw.pop("v_scale", None)
        scales = (None if k_scale is None and v_scale is None else  # run-time: an argument
                  jnp.stack([jnp.asarray(1.0 if x is None else x, jnp.float32).reshape(())
                             for x in (k_scale, v_scale)]))

        def attend(q, kc, vc, layer, window, sinks, chunk, scales, *metadata):
            def variant(name, interpret):
                return lambda *a: kernel.ragged_paged_attention(
                    *a[:-4], sliding_window=a[-4], sinks=a[-3], attention_chunk=a[-2],
                    k_scale=None if a[-1] is None else a[-1][0],
                    v_scale=None if a[-1] is None else a[-1][1],
                    variant=name, interpret=interpret, **kw)
            return lax.platform_dependent(
                q, kc, vc, layer, *metadata, window, sinks, chunk, scales,
                tpu=variant("tpu", False), cuda=variant("gpu", False),
                rocm=variant("gpu", False), default=variant("gpu", True))

        args = (q, kc, vc, layer, sliding_window, sinks, chunk, scales, md.kv_lens,
                md.block_tables, md.cu_q_lens, md.num_seqs)
        n = 1 if self.mesh is None else self.mesh.shape["model"]
        if n == 1:
            return attend(*args)
        if kc.shape[2] % n:  # KV heads replicated (do not divide): every device attends with
            # all heads, still under shard_map (XLA cannot partition a Mosaic call)
            return jax.shard_map(attend, mesh=self.mesh, in_specs=(P(),) * len(args),
                                 out_specs=P(), check_vma=False)(*args)
        heads, kv_heads = P(None, "model", None), P(None, None, "model", None, None)
        rest = [P()] * (len(args) - 3)
        rest[2] = P() if sinks is None else P("model")
        return jax.shard_map(attend, mesh=self.mesh, in_specs=(heads, kv_heads, kv_heads, *rest),
                             out_specs=heads, check_vma=False)(*args)

    def delta_rule_forms(self):
        """The platform's gated DeltaNet kernels (pallas_kernels/gated_delta_rule). On a mesh
        that shards the heads they run per shard of heads under `shard_map` (each shard's value
        heads read only their own key heads and state); where the key heads do not divide
        over the mesh, the reference (XLA partitions it)."""
        n = 1 if self.mesh is None else self.mesh.shape["model"]
        return tuple(self._per_shard(_platform_gdn(f), f, n)
                     for f in (gdn_ops.gated_delta_rule_recurrent,
                               gdn_ops.gated_delta_rule_chunked))

    def _per_shard(self, run, form, n):
        if n == 1:
            return run

        def sharded(q, k, v, g, beta, rec_state, *metadata):
            if k.shape[1] % n or v.shape[1] % n:
                reference = super(PallasBackend, self).delta_rule_forms()
                return reference[form is gdn_ops.gated_delta_rule_chunked](
                    q, k, v, g, beta, rec_state, *metadata)
            heads = P(None, "model", None)
            rows, state = P(None, "model"), P(None, "model", None, None)
            return jax.shard_map(run, mesh=self.mesh,
                                 in_specs=(heads, heads, heads, rows, rows, state)
                                 + (P(),) * len(metadata),
                                 out_specs=(heads, state), check_vma=False)(
                q, k, v, g, beta, rec_state, *metadata)
        return sharded

    def mla_attention(self, q, latent, cache: KVCache, layer, md: AttentionMetadata, *,
                      sm_scale, kv_lora_rank):
        """The platform's ragged paged attention kernel over the latent cache as multi-query
        attention, K and V both the latent (as pallas_kernels/ragged_paged_mla/reference.py
        does with the reference): no MLA kernel of its own yet, so it reads each latent page
        for K and again for V, and sums the Dr rotary values of V it drops."""
        kc = write_latent(cache.k, layer, latent, md.slot_mapping)
        out = self.attend(q, kc, kc, layer, md, sm_scale=sm_scale)
        return out[..., :kv_lora_rank], KVCache(kc, cache.v)


def _platform_gdn(form):
    """A delta-rule form running the kernel variant of the platform it lowers for (the GPU
    variant interpreted elsewhere: tests on CPU)."""
    def run(*args):
        def variant(name, interpret):
            return lambda *a: form(*a, variant=name, interpret=interpret)
        return lax.platform_dependent(*args, tpu=variant("tpu", False),
                                      cuda=variant("gpu", False), rocm=variant("gpu", False),
                                      default=variant("gpu", True))
    return run


def megablox_gmm(lhs, rhs, group_sizes, interpret: bool = False):
    """jax's Pallas grouped matmul (TPU), float32 out. Its row tile must divide the rows: they
    are padded to a multiple of it (the padding, past every group, is sliced off)."""
    M, K = lhs.shape
    N = rhs.shape[2]
    tm = min(128, -(-M // 8) * 8)
    padded = -(-M // tm) * tm
    lhs = jnp.pad(lhs, ((0, padded - M), (0, 0)))
    out = gmm(lhs, rhs, group_sizes, preferred_element_type=jnp.float32,
              tiling=(tm, min(128, K), min(128, N)), interpret=interpret)
    return out[:M]
