"""The speculative verifier (jaxllm/spec_decode/rejection.py): greedy exactness on ragged
batches, and a chi-square test that the first emitted token follows the target distribution
(temperature and top-k applied) for draft-model q and for n-gram point-mass drafts."""

import dataclasses

import jax
import numpy as np
import pytest
from scipy import stats

from jaxllm.layers.sampler import sample
from jaxllm.layers.sampling_tensors import SamplingTensors, draw_uniforms
from jaxllm.sampling_params import SamplingParams
from jaxllm.sequence import Sequence
from jaxllm.spec_decode.rejection import accept_uniforms, verify

_verify = jax.jit(verify)


def row_tensors(params: list[SamplingParams], num_draft, vocab, seeds):
    """SamplingTensors with one row per flat logit row: request r's params repeated for its
    num_draft[r] + 1 positions, the draw uniform of position j from (seed, j)."""
    seqs, steps = [], []
    for sp, n, seed in zip(params, num_draft, seeds):
        seqs += [Sequence(f"r{seed}", [1], sp, seed=int(seed))] * (n + 1)
        steps += list(range(n + 1))
    t = SamplingTensors.from_seqs(seqs, len(seqs), vocab, max_logprobs=0, penalty_width=8)
    return dataclasses.replace(t, uniforms=draw_uniforms([s.seed for s in seqs], steps))


def test_greedy_accepts_longest_matching_prefix_then_the_argmax():
    rng = np.random.default_rng(0)
    R, K, V = 6, 4, 100
    num_draft = np.array([4, 0, 2, 4, 1, 3])
    T = int((num_draft + 1).sum()) + 3  # padded rows past the requests are ignored
    logits = rng.normal(size=(T, V)).astype(np.float32)
    target = logits.argmax(1)
    starts = np.cumsum(num_draft + 1) - (num_draft + 1)
    accept_len = np.array([4, 0, 1, 0, 1, 2])  # drafts equal the argmax up to here
    drafts = rng.integers(0, V, (R, K)).astype(np.int32)
    for r in range(R):
        for j in range(num_draft[r]):
            good = target[starts[r] + j]
            drafts[r, j] = good if j < accept_len[r] else (good + 1) % V
    t = row_tensors([SamplingParams(temperature=0.0)] * R, num_draft, V, range(R))
    out = _verify(logits[:t.greedy.shape[0]], num_draft, drafts, t,
                  np.zeros((R, K), np.float32))
    np.testing.assert_array_equal(np.asarray(out.num_accepted), accept_len)
    for r in range(R):
        a = accept_len[r]
        want = target[starts[r]:starts[r] + a + 1]
        np.testing.assert_array_equal(np.asarray(out.token_ids[r, :a + 1]), want)
        assert (np.asarray(out.token_ids[r, a + 1:]) == -1).all()


def test_greedy_rows_in_a_sampled_batch_match_the_plain_sampler():
    """Mixed batch (not all_greedy): greedy rows still take the sampler's own argmax."""
    rng = np.random.default_rng(1)
    R, K, V = 8, 3, 300
    num_draft = np.full(R, K)
    params = [SamplingParams(temperature=0.0) if r % 2 else SamplingParams(temperature=0.8,
              top_k=20) for r in range(R)]
    t = row_tensors(params, num_draft, V, range(R))
    logits = rng.normal(size=(R * (K + 1), V)).astype(np.float32)
    plain = np.asarray(jax.jit(sample)(logits, t).token_ids).reshape(R, K + 1)
    drafts = plain[:, :K].astype(np.int32)  # every greedy row's drafts are the argmax
    drafts[1, 1] = (drafts[1, 1] + 1) % V   # ... but one rejected at position 1
    au = accept_uniforms(list(range(R)), [0] * R, K)
    out = _verify(logits, num_draft, drafts, t, au)
    a, toks = np.asarray(out.num_accepted), np.asarray(out.token_ids)
    for r in range(1, R, 2):
        want_a = 1 if r == 1 else K
        assert a[r] == want_a
        np.testing.assert_array_equal(toks[r, :want_a + 1], plain[r, :want_a + 1])
    # Deterministic given the seeds.
    again = _verify(logits, num_draft, drafts, t, au)
    np.testing.assert_array_equal(np.asarray(again.token_ids), toks)


def _target(logits, temperature, top_k=0, top_p=1.0, min_p=0.0, logit_bias=None):
    """NumPy oracle of the distribution the sampler draws from."""
    s = logits.astype(np.float64)
    for tok, b in (logit_bias or {}).items():
        s[tok] += b
    s = s / temperature
    p = np.exp(s - s.max())
    keep = p >= min_p * p.max()
    if top_k:
        keep &= s >= np.sort(s)[-top_k]
    p = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    order = np.argsort(-p, kind="stable")
    above = np.cumsum(p[order]) - p[order]
    cut = p[order][above < top_p].min()  # keep while the mass strictly above is < top_p
    p = np.where(p >= cut, p, 0.0)
    return p / p.sum()


CASES = {"top_k": dict(top_k=5),
         "top_p_min_p_bias": dict(top_p=0.95, min_p=0.02, logit_bias={6: 2.5})}


@pytest.mark.parametrize("filters", list(CASES))
@pytest.mark.parametrize("draft_model", [True, False], ids=["draft_q", "ngram_point_mass"])
def test_first_token_follows_the_target_distribution(draft_model, filters):
    rng = np.random.default_rng(2)
    N, K, V, temp = 12000, 3, 8, 0.7
    pos_logits = rng.normal(size=(K + 1, V)).astype(np.float32) * 1.5  # same for every request
    p0 = _target(pos_logits[0], temp, **CASES[filters])
    num_draft = np.arange(N) % (K + 1)  # ragged: 0..K drafts, one request after another
    if draft_model:
        q = rng.dirichlet(np.ones(V), size=K).astype(np.float32)  # [K, V], includes p0's zeros
        drafts = np.stack([rng.choice(V, N, p=q[j] / q[j].sum()) for j in range(K)], 1)
        draft_probs = np.broadcast_to(q, (N, K, V))
    else:
        # A point mass on one token (uniform drafts would hide a wrong residual): half the
        # requests propose p0's likeliest token, half one that top-k removes.
        drafts = rng.integers(0, V, (N, K))
        drafts[:, 0] = np.where(np.arange(N) % 2, p0.argmax(), p0.argmin())
        draft_probs = None
    seeds = np.arange(N) + 1000
    t = row_tensors([SamplingParams(temperature=temp, **CASES[filters])] * N, num_draft, V, seeds)
    logits = np.concatenate([pos_logits[:n + 1] for n in num_draft])
    out = _verify(logits, num_draft, drafts.astype(np.int32), t,
                  accept_uniforms(list(seeds), [0] * N, K), draft_probs)
    first = np.asarray(out.token_ids[:, 0])
    counts = np.bincount(first, minlength=V)
    kept = p0 > 0
    assert counts[~kept].sum() == 0  # nothing the filters removed is ever emitted
    assert stats.chisquare(counts[kept], p0[kept] / p0[kept].sum() * counts.sum()).pvalue > 1e-3
    # The first draft is accepted as often as theory says: sum(min(p, q)), or p(d) for n-gram.
    a, has = np.asarray(out.num_accepted), num_draft > 0
    want = (np.minimum(p0, q[0] / q[0].sum()).sum() if draft_model
            else p0[drafts[has, 0]].mean())
    assert abs((a[has] > 0).mean() - want) < 4 * np.sqrt(want * (1 - want) / has.sum())
    assert (a <= num_draft).all() and (a[~has] == 0).all()
    assert 0 < want < 1 and (a == K).any()  # both branches, and the bonus, were exercised
    emitted = np.asarray(out.token_ids)
    assert ((emitted >= 0).sum(1) == a + 1).all()
    for r in range(0, N, 97):  # the accepted drafts come out as proposed
        np.testing.assert_array_equal(emitted[r, :a[r]], drafts[r, :a[r]])
