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

Unlike `sample`, this materialises probabilities, _ROWS rows at a time (the sampler's
`_by_rows`), in two passes: every row's p(draft token), then one row per request (the position
after its accepted drafts) for the residual and the draw. All-greedy batches only run `sample`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxllm.layers.sampler import (_argmax, _by_rows, _exact_threshold, _first_above,
                                   _pad_vocab, process_logits, sample)
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
    T, V = logits.shape
    n = jnp.minimum(num_draft.astype(jnp.int32), K)
    j = jnp.arange(K + 1)[None, :]
    rows = (jnp.cumsum(n + 1) - (n + 1))[:, None] + jnp.minimum(j, n[:, None])  # [R, K+1]
    checked = j[:, :K] < n[:, None]
    d = jnp.clip(draft_ids, 0, V - 1)
    if t.all_greedy:  # the plain sampler's own argmax on every row, compared with the drafts
        target = sample(logits, t).token_ids[rows]
        a = jnp.cumprod((d == target[:, :K]) & checked, 1).sum(1).astype(jnp.int32)
        return VerifyOutput(a, jnp.where(j <= a[:, None], target, -1).astype(jnp.int32))

    # Pass 1, every row: the target probability of the draft token it checks.
    token = jnp.zeros(T, jnp.int32).at[jnp.where(checked, rows[:, :K], T)].set(d, mode="drop")
    p_d = _by_rows(_prob_of, logits, t, token)[rows[:, :K]]
    q_d = (jnp.ones_like(p_d) if draft_probs is None
           else jnp.take_along_axis(draft_probs, d[..., None], 2)[..., 0].astype(jnp.float32))
    ok = (accept_u * q_d < p_d) & checked  # u < p/q without dividing by q
    a = jnp.cumprod(ok, 1).sum(1).astype(jnp.int32)

    # Pass 2, one row per request (position a): the draw after the accepted drafts.
    at = lambda arr: jnp.take_along_axis(arr, jnp.minimum(a, arr.shape[1] - 1)[:, None], 1)[:, 0]
    row_a = at(rows)
    q_a = (jnp.zeros((R, 0), jnp.float32) if draft_probs is None
           else jax.vmap(lambda q, i: q[i])(draft_probs, jnp.minimum(a, K - 1)))
    last = _by_rows(_draw_after, logits[row_a], jax.tree.map(lambda x: x[row_a], t), q_a,
                    at(d), a < n)
    tokens = jnp.where(j < a[:, None], jnp.pad(d, ((0, 0), (0, 1))),
                       jnp.where(j == a[:, None], last[:, None], -1))
    return VerifyOutput(a, tokens.astype(jnp.int32))


def _prob_of(x, t, token):
    """p(token) under each row's target distribution: [c, V], [c] -> f32 [c]."""
    w = _target_weights(x, t)
    return jnp.take_along_axis(w, token[:, None], 1)[:, 0] / w.sum(-1)


def _draw_after(x, t, q, d, rejected):
    """A request's next token: from normalize(max(0, p - q)) where its draft d was rejected
    (q [c, V]; width 0 = n-gram, a point mass on d: p without d), from p where every draft was
    accepted (the bonus). Drawn with the row's uniform by inverse CDF, as the sampler draws."""
    V = x.shape[1]
    p = _target_weights(x, t)
    p = p / p.sum(-1, keepdims=True)
    if q.shape[1]:
        q = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, p.shape[1] - V)))
        residual = jnp.maximum(p - q, 0.0)
    else:
        residual = jnp.where(jnp.arange(p.shape[1])[None, :] == d[:, None], 0.0, p)
    w = jnp.where(rejected[:, None], residual, p)
    w = jnp.where(w.sum(-1, keepdims=True) > 0, w, p)  # p == q up to rounding: draw from p
    return jnp.clip(_first_above(w, t.uniforms * w.sum(-1)), 0, V - 1).astype(jnp.int32)


def _target_weights(x, t):
    """Rows of logits -> padded weights proportional to the probabilities `sample` draws from:
    processing, temperature, then exp over the tokens with x/T >= the row's min_p / top_k /
    top_p threshold (the sampler's exact threshold); greedy rows a point mass on the argmax."""
    x = x.astype(jnp.float32)  # as the sampler: a bf16 model's logits are sampled in f32
    x = _pad_vocab(process_logits(x, t) if t.needs_processing else x)
    s = x / t.temperature[:, None]
    m = jnp.max(s, -1)
    tau = m + jnp.log(t.min_p)  # min_p: p >= min_p * p_max; log(0) = -inf
    if t.needs_filters:
        tau = jax.vmap(_exact_threshold)(s, m, tau, t.top_k, t.top_p)
    e = jnp.where(s >= tau[:, None], jnp.exp(s - m[:, None]), 0.0)
    one_hot = lambda: jax.nn.one_hot(_argmax(x), x.shape[1], dtype=jnp.float32)
    return lax.cond(jnp.any(t.greedy), lambda: jnp.where(t.greedy[:, None], one_hot(), e),
                    lambda: e)
