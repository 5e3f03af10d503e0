"""Pallas gated DeltaNet: the chunked (WY) form for any ragged batch and the recurrent form for
decode steps, one kernel body for TPU (Mosaic) and GPU (Triton); tpu.py and gpu.py give each
platform its block specs and compiler parameters.

The math is reference.py's (same layout and arguments). What stays in XLA around the kernels:
q/k L2-norm and head repeat, cutting the ragged rows into each sequence's chunks of 64 (and
the cumulative decay in each chunk), and the state slots: each sequence's starting state is
gathered from its slot (zero when fresh) before the kernel and its final state scattered back
after, so the kernel only sees dense per-sequence states and never a slot index.

Chunked kernel, grid (head, sequence): the program of (h, s) walks sequence s's chunks in order
(a loop with the sequence's chunk range as bounds), carrying the [Dk, Dv] state in registers
(GPU) or vregs/VMEM (TPU). Per chunk: the unit-triangular (I + A)^-1 of the WY form as the
product (I - A)(I + A^2)(I + A^4)... (A strictly lower, so nilpotent), matmuls only; then the
chunk's outputs and the state update. The head's chunk arrays are one block (the sequence axis
varies fastest, so on TPU the output block stays resident while a head's sequences run).

Recurrent kernel, grid (head, row): one token's update of its sequence's state, elementwise
(its matrix-vector products are broadcast-multiply-sums: a one-row dot is below the Triton
minimum).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gated_delta_rule.reference import (CHUNK, _heads, _seq_of_tokens,
                                                         _slot_rows)

HI = lax.Precision.HIGHEST


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=HI)


def chunk_step(q, k, v, cc, cr, b, h):
    """One chunk of the delta rule: q/k [C, Dk], v [C, Dv], cc/b [C, 1], cr [1, C] (the
    chunk's cumulative log decay as a column and a row, its write strengths), h [Dk, Dv] the
    state before it -> (out [C, Dv], the state after it), all float32."""
    C = q.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    lower, strict, eye = col <= row, col < row, (col == row).astype(jnp.float32)
    pair = jnp.where(lower, jnp.exp(jnp.where(lower, cc - cr, 0.0)), 0.0)  # decay s -> t
    kb = k * b
    a = jnp.where(strict, _dot(kb, k.T) * pair, 0.0)
    inv, power = eye - a, a
    for _ in range(max(C - 1, 1).bit_length() - 1):
        power = _dot(power, power)
        inv = _dot(inv, eye + power)
    u = _dot(inv, v * b)
    w = _dot(inv, kb * jnp.exp(cc))
    last = lax.broadcasted_iota(jnp.int32, (1, C), 1) == C - 1
    total = jnp.sum(jnp.where(last, cr, 0.0), axis=1, keepdims=True)  # [1, 1]
    v_new = u - _dot(w, h)
    out = _dot(q * jnp.exp(cc), h) + _dot(_dot(q, k.T) * pair, v_new)
    return out, h * jnp.exp(total) + _dot((k * jnp.exp(total - cc)).T, v_new)


def chunked_kernel(first_ref, q_ref, k_ref, v_ref, cumc_ref, cumr_ref, beta_ref, h0_ref,
                   o_ref, hn_ref):
    """Program (h, s): sequence s's chunks first[s]..first[s+1] of head h, read and written
    in place (GPU: the refs are pointers). Refs (the head's arrays): q/k [NC, C, Dk], v/o
    [NC, C, Dv], cumc/beta [NC, C, 1], cumr [NC, 1, C], h0/hn [Dk, Dv]."""
    s = pl.program_id(1)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    def chunk(c, h):
        out, h = chunk_step(f32(q_ref[c]), f32(k_ref[c]), f32(v_ref[c]), cumc_ref[c],
                            cumr_ref[c], beta_ref[c], h)
        o_ref[c] = out.astype(o_ref.dtype)
        return h

    hn_ref[...] = lax.fori_loop(first_ref[s], first_ref[s + 1], chunk, f32(h0_ref[...]))


def recurrent_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, o_ref, hn_ref):
    """Program (h, t): row t's one-token update. q/k [Dk, 1] (columns), v/o [1, Dv], g/beta
    [1, 1], h0/hn [Dk, Dv]."""
    q, k = q_ref[...].astype(jnp.float32), k_ref[...].astype(jnp.float32)
    h = h0_ref[...].astype(jnp.float32) * jnp.exp(g_ref[...])
    kv_mem = jnp.sum(k * h, axis=0, keepdims=True)                      # [1, Dv]
    delta = (v_ref[...].astype(jnp.float32) - kv_mem) * beta_ref[...]
    h = h + k * delta
    o_ref[...] = jnp.sum(q * h, axis=0, keepdims=True).astype(o_ref.dtype)
    hn_ref[...] = h


def chunk_layout(q, k, v, g, beta, rec_state, slots, fresh, cu_q_lens, num_seqs,
                 chunk: int = CHUNK):
    """The chunked kernel's operands (head-major chunk arrays, each sequence's chunk range and
    starting state) and what maps its results back: (operands, flat, live, rows)."""
    T, Hv, Dv = v.shape
    N, S = rec_state.shape[0], slots.shape[0]
    NC = max(min(T // chunk + S, T), 1)
    seq, off = _seq_of_tokens(T, cu_q_lens, num_seqs)
    n = cu_q_lens[1:] - cu_q_lens[:-1]
    nchunks = jnp.where(jnp.arange(S) < num_seqs[0], (n + chunk - 1) // chunk, 0)
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nchunks)]).astype(jnp.int32)
    live = seq < S
    flat = jnp.where(live, first[jnp.minimum(seq, S - 1)] + off // chunk, NC) * chunk + off % chunk
    qf, kf, vf = _heads(q, k, v)  # float32, as the reference computes

    def to_chunks(x):  # [T, H, ...] -> [H, NC, chunk, ...], zeros where no row lands
        z = jnp.zeros((NC * chunk,) + x.shape[1:], x.dtype).at[flat].set(x, mode="drop")
        return jnp.moveaxis(z.reshape((NC, chunk) + x.shape[1:]), 2, 0)

    # Zero rows (padding) have beta 0 (write nothing) and g 0 (decay nothing).
    cum = jnp.cumsum(to_chunks(g.astype(jnp.float32)), axis=-1)        # [H, NC, C]
    rows = _slot_rows(slots, N, num_seqs)
    h0 = jnp.where(fresh[:, None, None, None], 0.0,
                   rec_state[jnp.minimum(rows, N - 1)].astype(jnp.float32))
    operands = (first, to_chunks(qf), to_chunks(kf), to_chunks(vf), cum[..., None],
                cum[..., None, :], to_chunks(beta.astype(jnp.float32))[..., None],
                jnp.swapaxes(h0, 0, 1))
    return operands, flat, live, rows


def finish_chunked(out, hn, flat, live, rows, rec_state, dtype):
    """The kernel's [H, NC, C, Dv] outputs back to rows [T, H, Dv] and its [H, S, Dk, Dv] final
    states into their slots."""
    H, NC, C, Dv = out.shape
    out = jnp.moveaxis(out, 0, 2).reshape(NC * C, H, Dv)
    out = jnp.take(out, jnp.minimum(flat, NC * C - 1), axis=0)
    out = jnp.where(live[:, None, None], out, 0).astype(dtype)
    rec = rec_state.at[rows].set(jnp.swapaxes(hn, 0, 1).astype(rec_state.dtype), mode="drop")
    return out, rec


def recurrent_layout(q, k, v, g, beta, rec_state, slots, fresh, cu_q_lens, num_seqs):
    """The recurrent kernel's operands (head-major rows; q, k as columns) and each row's slot."""
    T, N = q.shape[0], rec_state.shape[0]
    seq, _ = _seq_of_tokens(T, cu_q_lens, num_seqs)
    rows = jnp.concatenate([_slot_rows(slots, N, num_seqs), jnp.full((1,), N, jnp.int32)])[seq]
    fresh = jnp.concatenate([fresh, jnp.ones((1,), bool)])[seq]
    qf, kf, vf = _heads(q, k, v)
    h0 = jnp.where(fresh[:, None, None, None], 0.0,
                   rec_state[jnp.minimum(rows, N - 1)].astype(jnp.float32))
    hm = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731  [T, H, ...] -> [H, T, ...]
    operands = (hm(qf)[..., None], hm(kf)[..., None], hm(vf)[..., None, :],
                hm(g.astype(jnp.float32))[..., None, None],
                hm(beta.astype(jnp.float32))[..., None, None], hm(h0))
    return operands, rows


def finish_recurrent(out, hn, rows, rec_state, dtype):
    """[H, T, 1, Dv] outputs -> [T, H, Dv]; [H, T, Dk, Dv] states into the rows' slots."""
    out = jnp.swapaxes(out[:, :, 0], 0, 1).astype(dtype)
    return out, rec_state.at[rows].set(jnp.swapaxes(hn, 0, 1).astype(rec_state.dtype),
                                       mode="drop")
