"""Batched sampling inside the runner's jitted step: logits [S, V] -> tokens (+ raw logprobs).

Host side, `SamplingTensors.from_seqs` (jaxllm/sequence.py) packs every sequence's
SamplingParams into fixed-shape arrays; device side, `sample(logits, tensors)`
applies them per row, in vLLM's order:
allowed_token_ids -> min_tokens and logit_bias -> repetition/frequency/presence penalties ->
(greedy rows: argmax) -> temperature -> min_p -> top_k -> top_p -> draw.
Logprobs are of the raw logits (vLLM's default "raw_logprobs").
The runner calls `sample_rows(hidden, num_rows, compute_logits, tensors)` instead: S is fixed
(max_num_seqs), the number of real rows is a traced scalar, and a while loop computes and
samples the logits of 1, 16 or 64 rows per step (`LOGIT_ROWS`), so one program serves every
batch size and its cost follows num_rows, not S.

Compiled variants. Shapes are fixed by the runner: S = pad_to, V = vocab_size, the penalty table
width W (`penalty_width`, e.g. max_model_len plus room for logit_bias ids) and K = max_logprobs.
Exactly four static fields then select the program:
  all_greedy        every row greedy: no random draw at all
  needs_filters     some random row uses top_k or top_p (min_p alone does not need it)
  needs_processing  some row uses a penalty, logit_bias, allowed_token_ids or an active
                    min_tokens; when False the penalty table and banned bitmask have width 0
  num_logprobs      None (no row asked for logprobs) or max_logprobs (some row did)
all_greedy=True forces needs_filters=False: 4 + 8 = 12 variants (programs) per S, and
`warmup_tensors` returns one SamplingTensors for each. W stays fixed rather than bucketed (six
more programs per width): the [S, W] tables and the bitmask are zero-initialised, lazily paged,
aligned host arrays that jit reads in place on CPU, so only the real rows' entries cost anything.

Why the code looks like this (XLA:CPU): sorting a batch's vocabulary rows costs seconds, and
`jnp.argmax` over the vocabulary lowers to a slow loop where a plain max is an order of
magnitude cheaper; a fused reduction over many rows runs far slower per element than over a
few (docs/performance.md, 'Figures moved out of code comments'). So rows are sampled `_ROWS` at
a time, argmax and top-k go through block maxima, nothing sorts the vocabulary, and a draw is
an inverse CDF over block masses driven by one uniform per row, hashed on the host from (seed,
step): the same draw whatever else is in the batch, and no device RNG (threefry over [S, V] is
slow to run, and slow to compile per variant even for one number per row). top_k (k <= _CAND)
and most top_p cuts are decided exactly on the top _CAND candidates; the rest by an exact
per-row bisection.
A backend may run the plain draw (temperature and min_p) natively (`Backend.draw`): the CPU
backend's kernel does it in two passes over each row in cache.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxllm.layers.reductions import rowsum
from jaxllm.sequence import SamplingTensors

_ROWS = 8          # rows sampled together (a lax.map step, a sample_rows group)
# Rows per compute_logits call in sample_rows. Streaming the [V, E] weight costs a dot about as
# much for 16 rows as for 8 (and 64 rows well under 4x 16), while 1 row is a cheaper
# matrix-vector product: 1 for a lone row, 16 for small batches, 64 for the bulk.
LOGIT_ROWS = (1, 16, 64)
_BLOCK = 64        # vocab block for argmax and inverse-CDF masses; logits are padded to a multiple
_CAND = 128        # candidates that decide top_k (k <= _CAND) and most top_p cuts
_CAND_BLOCK = 32   # block size of the two-level candidate search


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array                       # int32 [S]
    logprobs: Optional[jax.Array] = None       # f32 [S]: raw logprob of the sampled token
    ranks: Optional[jax.Array] = None          # int32 [S]: tokens with logprob >= it (vLLM's rank)
    top_logprobs: Optional[jax.Array] = None   # f32 [S, K], K = num_logprobs, descending
    top_token_ids: Optional[jax.Array] = None  # int32 [S, K]


# ----------------------------------------------------------------------------- device side


def sample(logits: jax.Array, t: SamplingTensors) -> SamplerOutput:
    """logits [S, V] (any float dtype; sampled in f32) -> SamplerOutput. Jit-safe; every row
    independent of the others."""
    return _by_rows(_sample_rows, logits, t)


def sample_rows(rows: jax.Array, num_rows: jax.Array, compute_logits,
                t: SamplingTensors, logit_rows: tuple[int, ...] = LOGIT_ROWS,
                greedy_head=None, draw=None) -> SamplerOutput:
    """Sample the first num_rows (dynamic) of rows [S, E], t built with pad_to=S: one program
    for every batch size, and work that scales with num_rows, not S. Each loop step runs
    compute_logits ([c, E] -> f32 [c, V]) on the next c rows, c the smallest of logit_rows
    that covers the rows left (else the largest), then samples them _ROWS at a time; [S, V]
    logits never exist. Rows >= num_rows come out as don't-care values. The runner drops
    chunk sizes that run slowly (see ModelRunner.logit_rows). greedy_head ([c, E] -> int32
    [c], the first maximum of compute_logits), if given, replaces logits and sampling when
    every row is plainly greedy. draw (`Backend.draw`: logits [c, V], temperature, min_p,
    uniforms, greedy, live -> int32 [c]), if given, samples the logits of plain random steps
    (temperature and min_p only, no logprobs) in place of `_sample_rows`."""
    S, num_rows = rows.shape[0], jnp.asarray(num_rows, jnp.int32)
    sizes = sorted({min(c, S) for c in logit_rows})
    # Each chunk size samples its own logits: a [max c, V] buffer carried through the loop
    # cost a zero fill and a copy of the whole buffer per step.
    # Slices are clamped to stay in bounds, so a chunk or a group may overlap finished rows:
    # those are neither sampled for real nor written.

    plain_greedy = (greedy_head is not None and t.all_greedy and not t.needs_processing
                    and t.num_logprobs is None)
    plain_random = (draw is not None and not t.all_greedy and not t.needs_processing
                    and not t.needs_filters and t.num_logprobs is None)

    def chunk(c, done, out):
        first = jnp.minimum(done, S - c)  # logits [c, V] of the batch rows [first, first + c)
        x = lax.dynamic_slice_in_dim(rows, first, c)
        end = jnp.minimum(first + c, num_rows)
        batch_rows = first + jnp.arange(c)
        live = (batch_rows >= done) & (batch_rows < end)  # the chunk's rows not sampled yet

        def tokens_only(new):  # the chunk's whole-step tokens, written where live
            old = lax.dynamic_slice_in_dim(out.token_ids, first, c)
            return end, SamplerOutput(lax.dynamic_update_slice_in_dim(
                out.token_ids, jnp.where(live, new, old), first, 0))

        if plain_greedy:
            return tokens_only(greedy_head(x))
        logits = compute_logits(x).astype(jnp.float32)
        if plain_random:
            tc = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, first, c), t)
            return tokens_only(draw(logits, tc.temperature, tc.min_p, tc.uniforms, tc.greedy,
                                    live))
        R = min(_ROWS, c)

        def group(j, out):
            g = jnp.minimum(done - first + j * R, c - R)  # in logits; first + g in the batch
            tg = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, first + g, R), t)
            batch_rows = first + g + jnp.arange(R)
            new = (batch_rows >= done) & (batch_rows < end)
            # Other rows sample greedily (never the bisection fallback) and are not written.
            o = _sample_rows(lax.dynamic_slice_in_dim(logits, g, R),
                             dataclasses.replace(tg, greedy=tg.greedy | ~new))

            def put(buf, v):
                old = lax.dynamic_slice_in_dim(buf, first + g, R)
                v = jnp.where(new.reshape(-1, *[1] * (v.ndim - 1)), v, old)
                return lax.dynamic_update_slice_in_dim(buf, v, first + g, 0)

            return jax.tree.map(put, out, o)

        return end, lax.fori_loop(0, -(-(end - done) // R), group, out)

    def step(state):
        done, out = state
        k = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes), num_rows - done), len(sizes) - 1)
        return lax.switch(k, [partial(chunk, c) for c in sizes], done, out)

    V = jax.eval_shape(compute_logits, rows[:1]).shape[1]
    shapes = jax.eval_shape(_sample_rows, jax.ShapeDtypeStruct((1, V), jnp.float32),
                            jax.tree.map(lambda a: a[:1], t))
    out = jax.tree.map(lambda s: jnp.zeros((S, *s.shape[1:]), s.dtype), shapes)
    return lax.while_loop(lambda s: s[0] < jnp.minimum(num_rows, S), step, (jnp.int32(0), out))[1]


def token_logprobs(logits: jax.Array, token_ids: jax.Array, num_top: int):
    """Raw log-softmax of logits [S, V] at token_ids [S]: (logprob [S], vLLM rank [S], the top
    num_top logprobs [S, K] and their ids [S, K]). Also fits prompt logprobs (rows = positions)."""
    return _by_rows(lambda x, ids: _token_logprobs(x, ids, num_top), logits, token_ids)


def gathered_token_logprobs(hidden: jax.Array, row_idx: jax.Array, token_ids: jax.Array,
                            num_rows: jax.Array, compute_logits, num_top: int):
    """`token_logprobs` of token_ids[i] at hidden[row_idx[i]] ([T, E] hidden states), for the
    first num_rows (dynamic) of the P entries: the prompt logprobs of a step. Logits are computed
    LOGIT_ROWS[-1] rows at a time, so the cost follows num_rows and [P, V] logits never exist.
    Entries >= num_rows come out as don't-care values."""
    P = row_idx.shape[0]
    C = min(LOGIT_ROWS[-1], P)
    padded = -(-P // C) * C
    row_idx, token_ids = (jnp.pad(a, (0, padded - P)) for a in (row_idx, token_ids))

    def chunk(i, out):
        start = i * C
        rows = jnp.take(hidden, lax.dynamic_slice_in_dim(row_idx, start, C), axis=0)
        logits = compute_logits(rows).astype(jnp.float32)
        new = token_logprobs(logits, lax.dynamic_slice_in_dim(token_ids, start, C), num_top)
        return jax.tree.map(lambda buf, v: lax.dynamic_update_slice_in_dim(buf, v, start, 0),
                            out, new)

    V = jax.eval_shape(compute_logits, hidden[:1]).shape[1]
    shapes = jax.eval_shape(lambda x, ids: token_logprobs(x, ids, num_top),
                            jax.ShapeDtypeStruct((C, V), jnp.float32),
                            jax.ShapeDtypeStruct((C,), jnp.int32))
    out = jax.tree.map(lambda s: jnp.zeros((padded, *s.shape[1:]), s.dtype), shapes)
    num_chunks = jnp.minimum(-(-jnp.asarray(num_rows, jnp.int32) // C), padded // C)
    return jax.tree.map(lambda a: a[:P], lax.fori_loop(0, num_chunks, chunk, out))


def process_logits(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """allowed_token_ids, min_tokens, logit_bias, then repetition (HF: divide positive logits,
    multiply the others) and frequency/presence penalties (OpenAI), in vLLM's order.
    Only meaningful when t.needs_processing."""
    S, V = logits.shape
    ban = lambda x: jnp.where(_unpack_bits(t.banned_bits, V), -jnp.inf, x)
    x = lax.cond(jnp.any(t.banned_bits != 0), ban, lambda x: x, logits)
    rows = jnp.arange(S)[:, None]
    # Empty slots become V: out of range, so the gather fills them and the scatter drops them.
    ids = jnp.where(t.pen_ids > 0, t.pen_ids - 1, V)
    g = x.at[rows, ids].get(mode="fill", fill_value=0.0) + t.pen_bias
    r = t.repetition_penalty[:, None]
    g = jnp.where(t.pen_seen, jnp.where(g > 0, g / r, g * r), g)
    g = (g - t.frequency_penalty[:, None] * t.pen_counts
         - t.presence_penalty[:, None] * (t.pen_counts > 0))
    return x.at[rows, ids].set(g, mode="drop")


def _by_rows(f, *args):
    """f over chunks of _ROWS rows with lax.map, so each chunk's passes over V stay in cache."""
    S = jax.tree.leaves(args)[0].shape[0]
    c = math.gcd(S, _ROWS)
    if c == S:
        return f(*args)
    chunks = jax.tree.map(lambda a: a.reshape(S // c, c, *a.shape[1:]), args)
    out = lax.map(lambda a: f(*a), chunks)
    return jax.tree.map(lambda a: a.reshape(S, *a.shape[2:]), out)


def _sample_rows(logits, t):
    logits = logits.astype(jnp.float32)  # as vLLM: a bf16 model's logits are sampled in f32
    V = logits.shape[1]
    x = _pad_vocab(process_logits(logits, t) if t.needs_processing else logits)
    if t.all_greedy:
        tokens = _argmax(x)
    else:
        tokens = _random_tokens(x, t)
        greedy = lax.cond(jnp.any(t.greedy), _argmax, lambda x: jnp.zeros_like(tokens), x)
        tokens = jnp.where(t.greedy, greedy, tokens)
    tokens = jnp.clip(tokens, 0, V - 1).astype(jnp.int32)
    if t.num_logprobs is None:
        return SamplerOutput(tokens)
    return SamplerOutput(tokens, *_token_logprobs(logits, tokens, t.num_logprobs))


def _token_logprobs(logits, token_ids, num_top):
    x = _pad_vocab(logits)
    m = jnp.max(x, -1)
    lse = m + jnp.log(rowsum(jnp.exp(x - m[:, None])))
    chosen = jnp.take_along_axis(x, token_ids[:, None], 1)
    ranks = jnp.sum(jnp.where(x >= chosen, 1.0, 0.0), -1).astype(jnp.int32)
    top_v, top_i = _top_candidates(x, num_top)
    return chosen[:, 0] - lse, ranks, top_v - lse[:, None], top_i


def _pad_vocab(x):
    pad = -x.shape[1] % _BLOCK
    return jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x


def _unpack_bits(bits, V):
    shifts = jnp.arange(32, dtype=jnp.uint32)
    on = (bits[:, :, None] >> shifts) & 1
    return on.reshape(bits.shape[0], -1)[:, :V] == 1


def _argmax(x):
    """First index of the row max, via block maxima: jnp.argmax over V lowers to a slow loop on
    XLA:CPU, and a blockwise max is much cheaper (docs/performance.md has the figure)."""
    S, V = x.shape
    xb = x.reshape(S, V // _BLOCK, _BLOCK)
    b = jnp.argmax(xb.max(-1), -1)
    block = jnp.take_along_axis(xb, b[:, None, None], 1)[:, 0]
    return b * _BLOCK + jnp.argmax(block, -1)


def _top_candidates(x, k):
    """Exact top-k values (descending) and ids, searching only the k blocks with the largest
    maxima: every top-k element lies in one of them."""
    S, V = x.shape
    nb = V // _CAND_BLOCK
    if k == 0:
        return jnp.zeros((S, 0), x.dtype), jnp.zeros((S, 0), jnp.int32)
    if k >= nb:
        return lax.top_k(x, min(k, V))
    xb = x.reshape(S, nb, _CAND_BLOCK)
    _, blocks = lax.top_k(xb.max(-1), k)
    vals, pos = lax.top_k(jnp.take_along_axis(xb, blocks[:, :, None], 1).reshape(S, -1), k)
    ids = jnp.take_along_axis(blocks, pos // _CAND_BLOCK, 1) * _CAND_BLOCK + pos % _CAND_BLOCK
    return vals, ids


def _cumsum(w):
    """Row cumsum [S, n] as a Hillis-Steele scan of shifted elementwise adds: per row the same
    bits whatever S (a triangular matmul's order followed the dot's shape, and jnp.cumsum's
    associative scan is slow to compile on XLA:CPU)."""
    shift = 1
    while shift < w.shape[1]:
        w = w + jnp.pad(w[:, :-shift], ((0, 0), (shift, 0)))
        shift *= 2
    return w


def _first_above(w, target):
    """Inverse CDF over non-negative weights [S, n]: first index whose cumulative weight exceeds
    target [S], never one of zero weight (rounding falls back to the last positive index)."""
    c = _cumsum(w)
    ok = (c > target[:, None]) & (w > 0)
    last = jnp.max(jnp.where(w > 0, jnp.arange(w.shape[1]), 0), -1)
    return jnp.where(ok.any(-1), jnp.argmax(ok, -1), last)


def _block_mass(x, temp, m, tau):
    """Per-block mass of exp(x/T - m) over tokens with x/T >= tau: [S, V // _BLOCK]."""
    S, V = x.shape
    s = x / temp[:, None]
    e = jnp.where(s >= tau[:, None], jnp.exp(s - m[:, None]), 0.0)
    return rowsum(e.reshape(S, V // _BLOCK, _BLOCK))


def _draw(x, temp, m, tau, mass, u):
    """Inverse-CDF draw over the whole vocabulary: pick a block by mass, then a token in it."""
    S, V = x.shape
    target = u * rowsum(mass)
    b = _first_above(mass, target)
    before = jnp.take_along_axis(_cumsum(mass) - mass, b[:, None], 1)[:, 0]
    s = jnp.take_along_axis(x.reshape(S, -1, _BLOCK), b[:, None, None], 1)[:, 0] / temp[:, None]
    e = jnp.where(s >= tau[:, None], jnp.exp(s - m[:, None]), 0.0)
    return b * _BLOCK + _first_above(e, target - before)


def _random_tokens(x, t):
    """Temperature, min_p, top_k, top_p and the draw for every row (greedy rows are replaced
    by the caller). Each row keeps exactly the tokens with x/T >= its threshold."""
    S, V = x.shape
    temp, u = t.temperature, t.uniforms
    m = jnp.max(x, -1) / temp                       # = max(x / T): division is monotone
    tau = m + jnp.log(t.min_p)                      # min_p: p >= min_p * p_max; log(0) = -inf
    if not t.needs_filters:
        return _draw(x, temp, m, tau, _block_mass(x, temp, m, tau), u)

    C = min(_CAND, V)
    cand, cand_ids = _top_candidates(x, C)
    sc = cand / temp[:, None]
    k, p = t.top_k, t.top_p
    kth = jnp.take_along_axis(sc, jnp.clip(k - 1, 0, C - 1)[:, None], 1)[:, 0]
    tau = jnp.where((k > 0) & (k <= C), jnp.maximum(tau, kth), tau)
    inside = sc[:, -1] < tau                        # every survivor is a candidate
    mass = lax.cond(jnp.any(~t.greedy & ~inside), lambda: _block_mass(x, temp, m, tau),
                    lambda: jnp.zeros((S, V // _BLOCK), jnp.float32))

    # top_p on the candidates: keep while the mass strictly above a token is < p * Z.
    ec = jnp.where(sc >= tau[:, None], jnp.exp(sc - m[:, None]), 0.0)
    z = jnp.where(inside, rowsum(ec), rowsum(mass))
    above = _cumsum(ec) - ec
    top_p_on, big_k = p < 1, k > C
    keep = (ec > 0) & (~top_p_on[:, None] | (above < (p * z)[:, None]))
    cut = jnp.take_along_axis(sc, jnp.maximum(keep.sum(-1) - 1, 0)[:, None], 1)[:, 0]
    cand_ok = inside | (top_p_on & ~big_k & (sc[:, -1] < cut))
    w = jnp.where(sc >= jnp.maximum(tau, cut)[:, None], ec, 0.0)
    from_cand = jnp.take_along_axis(cand_ids, _first_above(w, u * rowsum(w))[:, None], 1)[:, 0]
    tokens = jnp.where(cand_ok, from_cand, _draw(x, temp, m, tau, mass, u))

    # Rows whose cut lies beyond the candidates: exact threshold by bisection, one row at a time.
    fallback = ~t.greedy & ~cand_ok & (top_p_on | big_k)
    rows = jnp.nonzero(fallback, size=S, fill_value=0)[0]

    def one_row(i, tokens):
        r = rows[i]
        xr = lax.dynamic_slice_in_dim(x, r, 1)
        tr, mr, ur = temp[r][None], m[r][None], u[r][None]
        tau_r = _exact_threshold(xr[0] / tr[0], mr[0], tau[r], jnp.where(big_k[r], k[r], 0), p[r])
        tau_r = tau_r[None]
        return tokens.at[r].set(_draw(xr, tr, mr, tau_r, _block_mass(xr, tr, mr, tau_r), ur)[0])

    return lax.fori_loop(0, fallback.sum(), one_row, tokens)


def _to_key(f):
    """float32 -> uint32 with the same order (NaN aside)."""
    b = lax.bitcast_convert_type(f, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | np.uint32(0x80000000))


def _from_key(key):
    b = jnp.where(key >> 31 == 1, key & np.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(b, jnp.float32)


def _largest_key(pred):
    """Largest uint32 K with pred(K), for pred true at 0 and monotone: 32 bit-by-bit steps."""
    def step(i, key):
        cand = key | (np.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(pred(cand), cand, key)
    return lax.fori_loop(0, 32, step, jnp.uint32(0))


def _exact_threshold(s, m, tau, k, p):
    """One row s [V]: the x/T threshold after top_k (k > 0) and top_p (p < 1) on the survivors
    s >= tau, found by bisection on the float order (the fallback when candidates cannot)."""
    keys = _to_key(s)
    kth = lambda: _from_key(_largest_key(lambda K: jnp.sum(keys >= K) >= k))
    off = lambda: jnp.float32(-jnp.inf)
    tau = jnp.maximum(tau, lax.cond(k > 0, kth, off))

    def nucleus():
        e = jnp.where(s >= tau, jnp.exp(s - m), 0.0)
        target = p * jnp.sum(e)
        last_dropped = _largest_key(lambda K: jnp.sum(jnp.where(keys > K, e, 0.0)) >= target)
        return _from_key(jnp.minimum(last_dropped, np.uint32(0xFFFFFFFE)) + 1)

    return jnp.maximum(tau, lax.cond(p < 1, nucleus, off))
