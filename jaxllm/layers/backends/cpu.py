"""The CPU backend: jaxllm's native C++ kernels through the XLA FFI (pallas_kernels/*/kernel_cpu).

The paged attention runs every step kind in one kernel that also writes the cache (f32, bf16 or
float8 caches, with a float8 cache's per-layer scales, and Gemma 3's bidirectional image
tokens; a float16 cache takes the reference). The projections (a MoE layer's router too), the
LM head and SiLU-and-mul run in the native matmul and activation kernels, and a MoE layer's
experts in the native grouped matmul, when they build (`native_matmul`); they read the stacked
weights in place, where XLA:CPU copies each layer's slice out of the scan, and run bf16
weights at f32 speed (XLA:CPU converts them first). Against XLA's dot they gain most at few rows, where
those copies and conversions dominate, and little at thousands of rows (docs/performance.md
has the figures). Kernels are built by `create` (start-up), so a trace never starts a C++
build.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp

from jaxllm.layers.attention import KVCache, native_cpu_attention
from jaxllm.layers.backends.reference import ReferenceBackend, from_bits
from jaxllm.layers.experts import experts_sorted, row_experts
from jaxllm.layers.quantization import QuantizedWeight, QuantSpec
from pallas_kernels.activation import kernel_cpu as activation_cpu
from pallas_kernels.grouped_matmul import kernel_cpu as grouped_cpu
from pallas_kernels.matmul import kernel_cpu as matmul_cpu
from pallas_kernels.ragged_paged_attention import kernel_cpu as attention_cpu
from pallas_kernels.sampling import kernel_cpu as sampling_cpu

# The layer projections the native matmul reads packed: whether the hidden size is their input
# (else their output), which fixes the row-major [L, in, out] view `pack` takes.
PROJECTIONS = {"qkv": True, "o": False, "gate_up": True, "down": False, "router": True,
               "shared_gate": True, "q_a": True, "q": True, "kv_a": True}
# Quantized weights the native matmul reads (`matmul_cpu.pack_quantized`): float8 ones run
# XLA's dot on their widened values.
NATIVE_QUANT = ("int8", "int4")
# The stacked experts of a MoE layer group ([L, X, ...]), which the grouped matmul reads packed
# (`grouped_cpu.pack`): their row-major [L, X, in, out] view.
EXPERTS = {"experts_gate_up": lambda L, X, E: (L, X, E, -1),
           "experts_down": lambda L, X, E: (L, X, -1, E)}


def build_projection_kernels(experts: bool = True) -> bool:
    """Build (once) the matmul and activation kernels, and with `experts` the grouped matmul
    (a dense model's start-up skips its build, seconds on a cold cache); False if this machine
    cannot."""
    return (matmul_cpu.available() and activation_cpu.available()
            and (not experts or grouped_cpu.available()))


@dataclasses.dataclass(frozen=True)
class CpuBackend(ReferenceBackend):
    name: ClassVar[str] = "cpu"
    native_matmul: bool = True
    native_sampling: bool = True
    native_quant: bool = False  # the layer projections are quantized and the matmul reads them

    @classmethod
    def create(cls, experts: bool = True, quant: Optional[QuantSpec] = None) -> "CpuBackend":
        """Build the kernels now: the attention kernel (`resolve_backend` checked it builds),
        and the projection (with `experts`, the MoE experts' too) and sampling kernels if they
        can be built here. quant: how the projections are quantized (None: float)."""
        attention_cpu.available()
        native = build_projection_kernels(experts)
        return cls(native_matmul=native, native_sampling=sampling_cpu.available(),
                   native_quant=native and quant is not None
                   and quant.weight_dtype in NATIVE_QUANT)

    @property
    def resident(self) -> frozenset:
        return frozenset(PROJECTIONS) | frozenset(EXPERTS) if self.native_matmul else frozenset()

    @property
    def resident_quantized(self) -> frozenset:
        return frozenset(PROJECTIONS) if self.native_quant else frozenset()

    def relayout(self, state, cfg):
        if self.native_matmul:
            state = pack_native(state, cfg, quantized=self.native_quant)
        return super().relayout(state, cfg)

    def embed(self, table, ids, width):
        if table.ndim == 2:  # not packed: an untied embedding
            return super().embed(table, ids, width)
        return from_bits(matmul_cpu.packed_rows(table, ids, width))  # packed as the LM head

    def _native(self, w) -> bool:
        """Whether the native matmul reads w (float, or quantized in its layout)."""
        return self.native_quant if isinstance(w, QuantizedWeight) else self.native_matmul

    def _matmul(self, x, w, layer, **kw):
        if isinstance(w, QuantizedWeight):
            parts = (w.q, w.scale) + (() if w.zero is None else (w.zero,))
            return matmul_cpu.matmul_quantized(x, parts, layer, **kw)
        return matmul_cpu.matmul(x, w, layer, **kw)

    def project(self, x, w, layer, *, n, out_dtype, bias=None):
        if not self._native(w):
            return super().project(x, w, layer, n=n, out_dtype=out_dtype, bias=bias)
        # The kernel rounds to bf16 itself where nothing is added first.
        y = self._matmul(x, w, layer, n=n,
                         out_dtype=jnp.float32 if bias is not None else out_dtype)
        return (y if bias is None else y + bias.reshape(n)).astype(out_dtype)

    def gated_project(self, x, w, layer, *, n, activation, dtype):
        if self._native(w) and activation == "silu":  # activated in the kernel, in cache
            return self._matmul(x, w, layer, n=n, out_dtype=dtype, gated=True)
        return super().gated_project(x, w, layer, n=n, activation=activation, dtype=dtype)

    def gated_activation(self, gate_up, activation, dtype):
        if self.native_matmul and isinstance(activation, str) and activation == "silu":
            return activation_cpu.silu_and_mul(gate_up, dtype)
        return super().gated_activation(gate_up, activation, dtype)

    def moe_impl(self, tokens, top_k, experts, dtype):
        """The native grouped matmul (`grouped`) at every batch size when it builds: it does
        only the routed work and reads only the experts that have tokens, in place. By
        scripts/bench_moe.py and scripts/bench_moe_step.py (docs/performance.md, 'Mixture of
        experts') it beats every XLA implementation from 1 token (`gather`) to 512 (`tiled`),
        and the packed experts leave the XLA ones nothing to read."""
        return "grouped" if self.native_matmul else super().moe_impl(tokens, top_k, experts,
                                                                      dtype)

    def moe(self, x, ids, weights, w_gate_up, w_down, layer, *, experts, ffn, activation, dtype,
            expert_parallel, gate_up_bias=None):
        if isinstance(w_gate_up, QuantizedWeight):  # the XLA experts on their widened weights
            return ReferenceBackend().moe(x, ids, weights, w_gate_up, w_down, layer,
                                          experts=experts, ffn=ffn, activation=activation,
                                          dtype=dtype, expert_parallel=expert_parallel,
                                          gate_up_bias=gate_up_bias)
        if not self.native_matmul:
            return super().moe(x, ids, weights, w_gate_up, w_down, layer, experts=experts,
                               ffn=ffn, activation=activation, dtype=dtype,
                               expert_parallel=expert_parallel, gate_up_bias=gate_up_bias)
        # One device (`resolve_backend`): every expert is here, whatever expert_parallel says.
        run = partial(grouped_cpu.grouped_matmul, layer=layer)

        def up(xs, sizes):  # SiLU in the kernel, on the gate/up sums while they are in cache
            if activation == "silu" and gate_up_bias is None:
                return run(xs, w_gate_up, sizes, n=ffn, out_dtype=dtype, gated=True)
            gate_up = run(xs, w_gate_up, sizes, n=2 * ffn).reshape(-1, 2, ffn)
            if gate_up_bias is not None:  # each sorted row's expert's bias
                gate_up = gate_up + gate_up_bias[row_experts(sizes, gate_up.shape[0])].astype(
                    jnp.float32)
            return self.gated_activation(gate_up, activation, dtype)

        return experts_sorted(x, ids, weights, experts, up,
                              lambda h, sizes: run(h, w_down, sizes, n=x.shape[1]))

    def attention(self, q, k, v, cache, layer, md, *, sm_scale, sliding_window=None,
                  soft_cap=None, sinks=None, attention_chunk=None, kv_scales=None):
        # The native kernel takes bidirectional image tokens (md.attend_to, Gemma 3) and a
        # float8 cache's per-layer scales as run-time operands; a float16 cache runs the XLA
        # reference.
        if not native_cpu_attention(self.name, cache.k.dtype):
            return super().attention(q, k, v, cache, layer, md, sm_scale=sm_scale,
                                     sliding_window=sliding_window, soft_cap=soft_cap,
                                     sinks=sinks, attention_chunk=attention_chunk,
                                     kv_scales=kv_scales)
        out, kc, vc = attention_cpu.ragged_paged_attention(
            q, k, v, cache.k, cache.v, layer, md.slot_mapping, md.kv_lens, md.block_tables,
            md.cu_q_lens, md.num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, sinks=sinks, attention_chunk=attention_chunk,
            attend_to=md.attend_to, kv_scales=kv_scales)
        return out, KVCache(kc, vc)

    def logits(self, hidden, w, vocab):
        if not self.native_matmul:
            return super().logits(hidden, w, vocab)
        return matmul_cpu.matmul(hidden, w, n=vocab)

    def greedy_head(self, w, vocab):
        """The native matmul keeps each 16 columns' maximum while they are in cache, so the
        [rows, vocabulary] logits are never written, sliced and reduced."""
        return partial(matmul_cpu.argmax, w=w, n=vocab) if self.native_matmul else None

    def draw(self):
        """The draw in two passes over each row in cache, several times faster than the XLA
        sampler's fused loops (docs/performance.md, "The decode step's host work and
        sampler")."""
        return sampling_cpu.draw if self.native_sampling else None

    def decode_programs(self, cache_dtype):
        return not native_cpu_attention(self.name, cache_dtype)

    def logit_rows(self, cfg, rows):
        # The native matmul runs every chunk size at speed.
        return tuple(rows) if self.native_matmul else super().logit_rows(cfg, rows)

    def batch_variance(self, cfg, cache_dtype):
        if not self.native_matmul:
            return "the native matmul kernels did not build here (XLA's dots run instead)"
        if cfg.quant is not None and not self.native_quant and not cfg.quant.experts_only:
            return (f"{cfg.quant.weight_dtype} weights run XLA's dots (the native matmul reads "
                    f"{' and '.join(NATIVE_QUANT)} ones)")
        if cfg.quant is not None and cfg.num_experts:
            return "quantized experts run XLA's dots (the native grouped matmul reads float ones)"
        if getattr(cfg, "kv_lora_rank", 0):
            return "multi-head latent attention runs the XLA reference (no native MLA kernel)"
        if not native_cpu_attention(self.name, cache_dtype):
            return (f"a {jnp.dtype(cache_dtype).name} KV cache runs the XLA attention (use "
                    "--kv-cache-dtype auto)")
        if cfg.lora is not None:
            return ("LoRA adapters' deltas run XLA's dots, in a form chosen by the step's "
                    "token count (jaxllm/layers/lora.py)")
        return None  # MoE layers too: router and experts run in the native kernels


def pack_native(state, cfg, quantized: bool = False):
    """The state with the layer projections (a MoE layer's router and shared gate among them),
    the MoE experts (`grouped_cpu.pack`) and the LM head (for tied embeddings the embedding,
    then looked up in place) in the native matmul's packed layout (strips of 16 output
    columns, `matmul_cpu.pack`): every read is sequential and no step repacks them, faster than
    row-major weights for the projections and most of all for the LM head (docs/performance.md
    has the figures). quantized: quantized projections too (`matmul_cpu.pack_quantized`),
    else they are left as they are."""
    E = cfg.hidden_size
    pack = _packer(lambda w, shape: matmul_cpu.pack(w.reshape(shape)))
    pack_experts = _packer(lambda w, shape: grouped_cpu.pack(w.reshape(shape)))
    for group in state["layers"].values():
        for name, e_in in PROJECTIONS.items():
            # A dense group has no router; a MoE one may have no MLP.
            if name not in group:
                continue
            if f"{name}_scale" in group:  # quantized: packed with its scales (zero points)
                if quantized:
                    _pack_quantized(group, name, E, e_in)
                continue
            L = jax.tree.leaves(group[name])[0].shape[0]
            shape = (L, E, -1) if e_in else (L, -1, E)
            group[name] = jax.tree.map(lambda w: pack(w, shape), group[name])
        for name, shape in EXPERTS.items():
            if name in group and f"{name}_scale" not in group:
                L, X = jax.tree.leaves(group[name])[0].shape[:2]
                group[name] = jax.tree.map(lambda w: pack_experts(w, shape(L, X, E)), group[name])
    head = "lm_head" if "lm_head" in state else "embed"
    if head in state:  # a middle pipeline stage has neither
        state[head] = jax.tree.map(lambda w: pack(w.T, (1, E, -1)), state[head])
    return state


def _pack_quantized(group, name: str, E: int, e_in: bool) -> None:
    """A quantized projection's values, scales and zero points (`QuantizedWeight`'s layout,
    stacked) in the native matmul's, in place in the group's state."""
    keys = [k for k in (name, f"{name}_scale", f"{name}_zero") if k in group]
    q, scale, *zero = [jax.tree.leaves(group[k])[0] for k in keys]
    L = q.shape[0]
    q = q.reshape((L, E, -1) if e_in else (L, -1, q.shape[-1]))
    flat = lambda a: a.reshape(L, a.shape[1], -1)  # noqa: E731  [L, groups, N]
    packed = jax.jit(matmul_cpu.pack_quantized)(q, flat(scale), *(flat(z) for z in zero))
    for k, a in zip(keys, packed):
        group[k] = jax.tree.map(lambda _, a=a: a, group[k])


def _packer(f):
    """f(w, shape) jitted, donating w where the packed result can take its buffer (no padding:
    the same size); a router's 8 columns padded to 16 cannot, and XLA would warn."""
    donating = jax.jit(f, static_argnums=1, donate_argnums=0)
    keeping = jax.jit(f, static_argnums=1)

    def run(w, shape):
        out = jax.eval_shape(lambda w: f(w, shape), w)
        return (donating if out.size == w.size and out.dtype == w.dtype else keeping)(w, shape)
    return run
