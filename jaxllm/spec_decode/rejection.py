"""Verification of speculative drafts in the jitted step: accept a prefix, emit one more token.

The target scored K+1 positions of every request in one ragged step: request r's flat logit
rows are num_draft[r] + 1 consecutive rows (the rows after its last accepted token, then one
per draft token), requests one after the other. `verify` applies every row's SamplingTensors
to those logits with the plain sampler's own functions (processing, min_p, and top_k/top_p by
its exact threshold), so the target distribution p is the one `sample` draws from. Then, per
request and position j < num_draft:
  greedy rows   accept while the draft equals the target's argmax; emit the argmax after the
                last accepted draft (the correction, or the bonus when all are accepted);
  sampled rows  accept draft d with probability min(1, p(d) / q(d)); at the first rejection
                emit a draw from normalize(max(0, p - q)), or from p at position num_draft
                (the bonus) when all were accepted. q is the draft model's distribution, or,
                for n-gram drafts (draft_probs None), a point mass on d: accept with p(d), and
                on rejection draw from p without d.
This makes each emitted token's distribution exactly the target's (Leviathan et al. 2023).
Deterministic: acceptance uses `accept_uniforms` (host, from each request's seed and step)
and a draw uses the row's `uniforms` as the plain sampler does.

Unlike `sample`, this materialises the probabilities of each request's K+1 rows; requests are
processed _ROWS at a time (the sampler's `_by_rows`) so that stays [8 * (K+1), V] at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.sampler import (_argmax, _by_rows, _exact_threshold, _first_above,
                                   _pad_vocab, process_logits)
from jaxllm.layers.sampling_tensors import SamplingTensors, draw_uniforms

# Salt that separates acceptance uniforms from the draw uniforms of the same (seed, step).
_ACCEPT_SALT = 0x5DEECE66D


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    num_accepted: jax.Array  # int32 [R]: draft tokens accepted (0..num_draft)
    token_ids: jax.Array     # int32 [R, K+1]: num_accepted + 1 emitted tokens, then -1


def accept_uniforms(seeds: list[int], steps: list[int], k: int) -> np.ndarray:
    """f32 [R, k]: the uniform that accepts or rejects draft j of a request whose next output
    token is number steps[r]; a function of (seed, step + j) only, like the draw uniforms."""
    salted = [int(s) ^ _ACCEPT_SALT for s in seeds]
    return np.stack([draw_uniforms(salted, [n + j for n in steps]) for j in range(k)], 1) \
        if k else np.zeros((len(seeds), 0), np.float32)


def verify(logits: jax.Array, num_draft: jax.Array, draft_ids: jax.Array, t: SamplingTensors,
           accept_u: jax.Array, draft_probs: Optional[jax.Array] = None) -> VerifyOutput:
    """logits [T, V] flat ragged rows (request r's num_draft[r] + 1 rows consecutive, T >=
    their total; rows past it are ignored); t: SamplingTensors with T rows, aligned with the
    logits (row j of a request carries its params with j drafts appended to the output, so
    penalties, min_tokens and the draw uniform follow the position); num_draft int32 [R];
    draft_ids int32 [R, K]; accept_u f32 [R, K]; draft_probs f32 [R, K, V] or None (n-gram)."""
    R, K = draft_ids.shape
    num_draft = jnp.minimum(num_draft.astype(jnp.int32), K)
    starts = jnp.cumsum(num_draft + 1) - (num_draft + 1)
    j = jnp.arange(K + 1)
    rows = starts[:, None] + jnp.minimum(j[None, :], num_draft[:, None])  # [R, K+1]
    per_pos = jax.tree.map(lambda a: a[rows], (logits, t))
    args = per_pos + (num_draft, draft_ids, accept_u)
    if draft_probs is not None:
        args += (draft_probs,)
    return _by_rows(_verify_requests, *args)


def _verify_requests(x, t, n, d, accept_u, q=None):
    """A group of c requests: x [c, K+1, V], t fields [c, K+1, ...]."""
    c, K1, V = x.shape
    K = K1 - 1
    flat = lambda a: a.reshape(c * K1, *a.shape[2:])
    x, t = flat(x).astype(jnp.float32), jax.tree.map(flat, t)
    x = _pad_vocab(process_logits(x, t) if t.needs_processing else x)
    j = jnp.arange(K1)[None, :]
    if t.all_greedy:
        target = _argmax(x).reshape(c, K1)
        ok = (d == target[:, :K]) & (j[:, :K] < n[:, None])
        a = jnp.cumprod(ok, 1).sum(1).astype(jnp.int32)
        return VerifyOutput(a, jnp.where(j <= a[:, None], target, -1).astype(jnp.int32))

    p = _target_probs(x, t).reshape(c, K1, -1)
    Vp = p.shape[-1]
    d_safe = jnp.clip(d, 0, V - 1)
    p_d = jnp.take_along_axis(p[:, :K], d_safe[..., None], 2)[..., 0]
    if q is None:
        q_d = jnp.ones_like(p_d)
    else:
        q = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, Vp - V)))
        q_d = jnp.take_along_axis(q, d_safe[..., None], 2)[..., 0]
    ok = (accept_u * q_d < p_d) & (j[:, :K] < n[:, None])  # u < p/q without dividing by q
    a = jnp.cumprod(ok, 1).sum(1).astype(jnp.int32)

    pick = lambda arr: jnp.take_along_axis(arr, jnp.minimum(a, arr.shape[1] - 1)[:, None, None],
                                           1)[:, 0]
    p_a = pick(p)
    if q is None:
        q_a = jax.nn.one_hot(pick(d_safe[..., None])[:, 0], Vp, dtype=jnp.float32)
    else:
        q_a = pick(q)
    w = jnp.where((a < n)[:, None], jnp.maximum(p_a - q_a, 0.0), p_a)
    w = jnp.where(w.sum(-1, keepdims=True) > 0, w, p_a)  # p == q up to rounding: draw from p
    u = jnp.take_along_axis(t.uniforms.reshape(c, K1), a[:, None], 1)[:, 0]
    last = jnp.clip(_first_above(w, u * w.sum(-1)), 0, V - 1).astype(jnp.int32)
    draft = jnp.pad(d, ((0, 0), (0, 1)))
    tokens = jnp.where(j < a[:, None], draft, jnp.where(j == a[:, None], last[:, None], -1))
    return VerifyOutput(a, tokens.astype(jnp.int32))


def _target_probs(x, t):
    """Rows of padded, processed logits -> the probabilities `sample` draws from: temperature,
    then the tokens with x/T >= the row's min_p / top_k / top_p threshold (the sampler's exact
    threshold), renormalised; greedy rows are a point mass on the argmax."""
    s = x / t.temperature[:, None]
    m = jnp.max(s, -1)
    tau = m + jnp.log(t.min_p)  # min_p: p >= min_p * p_max; log(0) = -inf
    if t.needs_filters:
        tau = jax.vmap(_exact_threshold)(s, m, tau, t.top_k, t.top_p)
    e = jnp.where(s >= tau[:, None], jnp.exp(s - m[:, None]), 0.0)
    p = e / e.sum(-1, keepdims=True)
    greedy = jax.nn.one_hot(_argmax(x), x.shape[1], dtype=jnp.float32)
    return jnp.where(t.greedy[:, None], greedy, p)
