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


def _target(logits, temperature, top_k):
    s = logits.astype(np.float64) / temperature
    keep = s >= np.sort(s)[-top_k]
    p = np.where(keep, np.exp(s - s.max()), 0.0)
    return p / p.sum()


@pytest.mark.parametrize("draft_model", [True, False], ids=["draft_q", "ngram_point_mass"])
def test_first_token_follows_the_target_distribution(draft_model):
    rng = np.random.default_rng(2)
    N, K, V, temp, top_k = 12000, 3, 8, 0.7, 5
    pos_logits = rng.normal(size=(K + 1, V)).astype(np.float32) * 1.5  # same for every request
    p0 = _target(pos_logits[0], temp, top_k)
    num_draft = np.full(N, K)
    if draft_model:
        q = rng.dirichlet(np.ones(V), size=K).astype(np.float32)  # [K, V], includes p0's zeros
        drafts = np.stack([rng.choice(V, N, p=q[j] / q[j].sum()) for j in range(K)], 1)
        draft_probs = np.broadcast_to(q, (N, K, V))
    else:
        drafts = rng.integers(0, V, (N, K))  # lookups propose anything, also banned tokens
        draft_probs = None
    seeds = np.arange(N) + 1000
    t = row_tensors([SamplingParams(temperature=temp, top_k=top_k)] * N, num_draft, V, seeds)
    logits = np.tile(pos_logits, (N, 1))
    out = _verify(logits, num_draft, drafts.astype(np.int32), t,
                  accept_uniforms(list(seeds), [0] * N, K), draft_probs)
    first = np.asarray(out.token_ids[:, 0])
    counts = np.bincount(first, minlength=V)
    kept = p0 > 0
    assert counts[~kept].sum() == 0  # nothing outside top-k is ever emitted
    assert stats.chisquare(counts[kept], p0[kept] / p0[kept].sum() * counts.sum()).pvalue > 1e-3
    # The test has power: the drafts' own first tokens are far from the target.
    draft_counts = np.bincount(drafts[:, 0], minlength=V)
    assert draft_counts[~kept].sum() > 0 or \
        stats.chisquare(draft_counts[kept], p0[kept] / p0[kept].sum()
                        * draft_counts[kept].sum()).pvalue < 1e-6
    # Some drafts are accepted and some rejected, so both branches were exercised.
    a = np.asarray(out.num_accepted)
    assert 0 < (a > 0).mean() < 1 and (a == K).any()
    emitted = np.asarray(out.token_ids)
    assert ((emitted >= 0).sum(1) == a + 1).all()
