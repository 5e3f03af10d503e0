"""Pure-JAX gated DeltaNet over a ragged batch with per-sequence state slots: the reference.

Layout (as pallas_kernels/ragged_paged_attention/reference.py for the ragged part):
  x             [T, C]                  flat ragged batch: sequence s owns rows
                                        cu_q_lens[s]:cu_q_lens[s+1]
  q, k          [T, Hk, Dk]             after the short convolution
  v             [T, Hv, Dv]             Hv a multiple of Hk (each k head serves Hv/Hk v heads)
  g, beta       float32 [T, Hv]         log decay (<= 0) and write strength of each token
  conv_state    [N, C, W - 1]           each slot: the last W - 1 inputs of the convolution
  rec_state     float32 [N, Hv, Dk, Dv] each slot: the delta rule's state matrix
  slots         int32 [S]               each sequence's state slot (< 0 or >= N: padding)
  fresh         bool [S]                the sequence starts here (its first token is position
                                        0): its states start at zero, not from the slot
  cu_q_lens, num_seqs                   as the paged attention's
The recurrence per head, each token t (S the state, q scaled by Dk^-1/2, q and k L2-normed):
  S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
`gated_delta_rule_chunked` computes it 64 tokens at a time (the WY form: one unit-triangular inverse
per chunk for the intra-chunk part, one state update per chunk), each sequence's chunks
aligned to its own first token; `gated_delta_rule_recurrent` is the one-token update that
decode steps run. Both read each sequence's state from its slot and write the state after its
last token back, so a prompt split over steps (chunked prefill) carries on where it stopped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64


def _seq_of_tokens(T: int, cu_q_lens: jax.Array, num_seqs: jax.Array):
    """Each row's sequence and its offset in the sequence's rows of this step; rows past the
    last sequence get sequence index S (padding)."""
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens, t, side="right", method="compare_all").astype(jnp.int32) - 1
    S = cu_q_lens.shape[0] - 1
    seq = jnp.where((seq < num_seqs[0]) & (seq < S), seq, S)
    start = jnp.concatenate([cu_q_lens, cu_q_lens[-1:]])[seq]
    return seq, t - start


def _slot_rows(slots: jax.Array, num_slots: int, num_seqs: jax.Array) -> jax.Array:
    """Each sequence's slot, padding sequences (and slots out of range) mapped to num_slots,
    one past the end: reads of it are clamped and ignored, writes to it dropped."""
    live = (jnp.arange(slots.shape[0]) < num_seqs[0]) & (slots >= 0) & (slots < num_slots)
    return jnp.where(live, slots, num_slots)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum x^2 + eps) over the last axis, in float32 (the FLA library's l2norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv1d(x: jax.Array, weight: jax.Array, conv_state: jax.Array, slots: jax.Array,
                  fresh: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                  activation: str = "silu") -> tuple[jax.Array, jax.Array]:
    """The depthwise causal convolution of each sequence's rows x [T, C] (weight [C, W]),
    continuing from the sequence's conv state -> (out [T, C] in x's dtype, conv_state with
    each live sequence's last W - 1 inputs). Accumulates in float32."""
    T, C = x.shape
    W = weight.shape[1]
    N = conv_state.shape[0]
    seq, off = _seq_of_tokens(T, cu_q_lens, num_seqs)
    rows = _slot_rows(slots, N, num_seqs)
    fresh_ = jnp.concatenate([fresh, jnp.ones((1,), bool)])
    rows_ = jnp.concatenate([rows, jnp.full((1,), N, rows.dtype)])
    # The state each row's sequence started from, [T, C, W - 1] (zeros when fresh).
    old = jnp.where(fresh_[seq][:, None, None], 0,
                    conv_state[jnp.minimum(rows_[seq], N - 1)]).astype(jnp.float32)
    xf = x.astype(jnp.float32)
    acc = xf * weight[:, W - 1].astype(jnp.float32)
    for d in range(1, W):  # input d rows back: this step's row, or the state's column
        prev = jnp.roll(xf, d, axis=0)
        col = jnp.clip(W - 1 - d + off, 0, W - 2)
        from_state = jnp.take_along_axis(old, col[:, None, None], axis=2)[..., 0]
        acc = acc + jnp.where((off >= d)[:, None], prev, from_state) * \
            weight[:, W - 1 - d].astype(jnp.float32)
    if activation == "silu":
        acc = jax.nn.silu(acc)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: activation {activation!r}")
    # New state column p: the input W - 1 - p rows before the sequence's end.
    n = cu_q_lens[1:] - cu_q_lens[:-1]
    p = jnp.arange(W - 1)
    idx = n[:, None] + p[None, :] - (W - 1)                     # [S, W-1], < 0: old state
    src = jnp.clip(cu_q_lens[:-1, None] + idx, 0, T - 1)
    old_s = jnp.where(fresh[:, None, None], 0,
                      conv_state[jnp.minimum(rows, N - 1)]).astype(x.dtype)  # [S, C, W-1]
    old_col = jnp.take_along_axis(old_s, jnp.clip(W - 1 + idx, 0, W - 2)[:, None, :], axis=2)
    new = jnp.where((idx >= 0)[:, None, :], jnp.swapaxes(x[src], 1, 2), old_col)
    conv_state = conv_state.at[rows].set(new.astype(conv_state.dtype), mode="drop")
    return acc.astype(x.dtype), conv_state


def _heads(q, k, v):
    """q, k [T, Hk, Dk] L2-normed in float32 and repeated to Hv heads (q scaled by
    Dk^-1/2); v in float32."""
    rep = v.shape[1] // k.shape[1]
    q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5)
    if rep > 1:
        q, k = jnp.repeat(q, rep, axis=1), jnp.repeat(k, rep, axis=1)
    return q, k, v.astype(jnp.float32)


def gated_delta_rule_recurrent(q, k, v, g, beta, rec_state, slots, fresh, cu_q_lens, num_seqs
                               ) -> tuple[jax.Array, jax.Array]:
    """At most one row per sequence (a decode step; other rows are padding) -> (out
    [T, Hv, Dv] in v's dtype, rec_state updated)."""
    T, N = q.shape[0], rec_state.shape[0]
    seq, _ = _seq_of_tokens(T, cu_q_lens, num_seqs)
    rows = jnp.concatenate([_slot_rows(slots, N, num_seqs), jnp.full((1,), N, jnp.int32)])[seq]
    fresh = jnp.concatenate([fresh, jnp.ones((1,), bool)])[seq]
    qf, kf, vf = _heads(q, k, v)
    h = jnp.where(fresh[:, None, None, None], 0, rec_state[jnp.minimum(rows, N - 1)])
    h = h * jnp.exp(g.astype(jnp.float32))[..., None, None]
    kv_mem = jnp.einsum("thkv,thk->thv", h, kf)
    delta = (vf - kv_mem) * beta.astype(jnp.float32)[..., None]
    h = h + kf[..., :, None] * delta[..., None, :]
    out = jnp.einsum("thkv,thk->thv", h, qf)
    return out.astype(v.dtype), rec_state.at[rows].set(h, mode="drop")


def gated_delta_rule_chunked(q, k, v, g, beta, rec_state, slots, fresh, cu_q_lens, num_seqs,
                             chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """Any ragged batch (prefill chunks and decode rows alike) -> (out [T, Hv, Dv] in v's
    dtype, rec_state updated). Each sequence's rows are cut into chunks of `chunk` from its
    first row; the chunk layout holds at most T // chunk + S chunks (and at most T)."""
    T, Hv, Dv = v.shape
    Dk, N, S = q.shape[-1], rec_state.shape[0], slots.shape[0]
    NC = min(T // chunk + S, T)
    seq, off = _seq_of_tokens(T, cu_q_lens, num_seqs)
    n = cu_q_lens[1:] - cu_q_lens[:-1]
    nchunks = jnp.where(jnp.arange(S) < num_seqs[0], (n + chunk - 1) // chunk, 0)
    first_chunk = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nchunks)])
    # Row t's place in the chunk layout [NC, chunk]; padding rows go past the end.
    live = seq < S
    seq_c = jnp.minimum(seq, S - 1)
    c_of = jnp.where(live, first_chunk[seq_c] + off // chunk, NC)
    flat = c_of * chunk + off % chunk
    qf, kf, vf = _heads(q, k, v)
    gf, bf = g.astype(jnp.float32), beta.astype(jnp.float32)

    def to_chunks(x):  # [T, ...] -> [NC, chunk, ...], zeros where no row lands
        z = jnp.zeros((NC * chunk,) + x.shape[1:], x.dtype)
        return z.at[flat].set(x, mode="drop").reshape((NC, chunk) + x.shape[1:])

    # Zeroed pad rows have beta 0 (they write nothing) and g 0 (they decay nothing).
    qc, kc, vc, gc, bc = (jnp.swapaxes(to_chunks(a), 1, 2) for a in (qf, kf, vf, gf, bf))
    # qc/kc [NC, H, C, Dk], vc [NC, H, C, Dv], gc/bc [NC, H, C]
    cum = jnp.cumsum(gc, axis=-1)
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    pair = jnp.where(lower, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0)),
                     0.0)                                       # decay from s to t, s <= t
    kb, vb = kc * bc[..., None], vc * bc[..., None]
    hi = jax.lax.Precision.HIGHEST
    a = jnp.einsum("nhtd,nhsd->nhts", kb, kc, precision=hi) * pair
    # (I + A)^-1 for the strictly lower A of the chunk's "UT" system, as the product
    # (I - A)(I + A^2)(I + A^4)...: A is nilpotent (A^chunk = 0), so this is the whole Neumann
    # series, in matmuls only (no triangular solve: XLA:CPU runs that as a LAPACK call).
    a = jnp.where(jnp.tril(jnp.ones((chunk, chunk), bool), -1), a, 0)
    eye = jnp.eye(chunk, dtype=a.dtype)
    inv, power = eye - a, a
    for _ in range(max(chunk - 1, 1).bit_length() - 1):
        power = jnp.einsum("nhts,nhsr->nhtr", power, power, precision=hi)
        inv = jnp.einsum("nhts,nhsr->nhtr", inv, eye + power, precision=hi)
    u = jnp.einsum("nhts,nhsv->nhtv", inv, vb, precision=hi)
    w = jnp.einsum("nhts,nhsd->nhtd", inv, kb * jnp.exp(cum)[..., None], precision=hi)
    attn = jnp.einsum("nhtd,nhsd->nhts", qc, kc, precision=hi) * pair
    q_dec = qc * jnp.exp(cum)[..., None]
    k_dec = kc * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])                         # [NC, H]
    # Chunk c's sequence, whether it is that sequence's first chunk, and its slot.
    c = jnp.arange(NC)
    c_seq = jnp.clip(jnp.searchsorted(first_chunk, c, side="right", method="compare_all") - 1, 0, S)
    c_live = c < first_chunk[-1]
    rows = jnp.concatenate([_slot_rows(slots, N, num_seqs), jnp.full((1,), N, jnp.int32)])
    c_rows = jnp.where(c_live, rows[c_seq], N)
    fresh_ = jnp.concatenate([fresh, jnp.ones((1,), bool)])
    c_start = c_live & (c == first_chunk[jnp.minimum(c_seq, S)])
    c_zero = c_start & fresh_[c_seq]

    def step(state, xs):
        row, start, zero, u_c, w_c, q_c, k_c, attn_c, dec_c = xs
        h = jnp.where(start, jnp.where(zero, 0, state[jnp.minimum(row, N - 1)]), state[N])
        v_new = u_c - jnp.einsum("htd,hdv->htv", w_c, h, precision=hi)
        out = (jnp.einsum("htd,hdv->htv", q_c, h, precision=hi)
               + jnp.einsum("hts,hsv->htv", attn_c, v_new, precision=hi))
        h = h * dec_c[:, None, None] + jnp.einsum("htd,htv->hdv", k_c, v_new, precision=hi)
        state = state.at[row].set(h, mode="drop").at[N].set(h)
        return state, out

    # The carried states: every slot, plus a scratch one (index N) holding the running state.
    carry = jnp.concatenate([rec_state, jnp.zeros((1, Hv, Dk, Dv), rec_state.dtype)])
    carry, out = jax.lax.scan(step, carry, (c_rows, c_start, c_zero, u, w, q_dec, k_dec, attn,
                                            chunk_decay))
    out = jnp.swapaxes(out, 1, 2).reshape(NC * chunk, Hv, Dv)
    out = jnp.take(out, jnp.minimum(flat, NC * chunk - 1), axis=0)
    out = jnp.where(live[:, None, None], out, 0)
    return out.astype(v.dtype), carry[:N]
