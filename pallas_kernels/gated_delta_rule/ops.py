"""The Pallas gated DeltaNet ops with reference.py's signatures: `variant` "tpu" or "gpu" picks
the platform's kernel (tpu.py, gpu.py); `interpret` runs it in Pallas' interpreter (tests)."""

from __future__ import annotations

import jax

from pallas_kernels.gated_delta_rule import gpu, kernel, tpu

VARIANTS = {"tpu": tpu, "gpu": gpu}


def gated_delta_rule_chunked(q, k, v, g, beta, rec_state, slots, fresh, cu_q_lens, num_seqs, *,
                             variant: str, interpret: bool = False
                             ) -> tuple[jax.Array, jax.Array]:
    """Any ragged batch -> (out [T, Hv, Dv] in v's dtype, rec_state updated)."""
    operands, flat, live, rows = kernel.chunk_layout(q, k, v, g, beta, rec_state, slots, fresh,
                                                     cu_q_lens, num_seqs)
    out, hn = VARIANTS[variant].chunked(*operands, interpret=interpret)
    return kernel.finish_chunked(out, hn, flat, live, rows, rec_state, v.dtype)


def gated_delta_rule_recurrent(q, k, v, g, beta, rec_state, slots, fresh, cu_q_lens, num_seqs,
                               *, variant: str, interpret: bool = False
                               ) -> tuple[jax.Array, jax.Array]:
    """At most one row per sequence -> (out [T, Hv, Dv] in v's dtype, rec_state updated)."""
    operands, rows = kernel.recurrent_layout(q, k, v, g, beta, rec_state, slots, fresh,
                                             cu_q_lens, num_seqs)
    out, hn = VARIANTS[variant].recurrent(*operands, interpret=interpret)
    return kernel.finish_recurrent(out, hn, rows, rec_state, v.dtype)
