"""The jitted sampler against NumPy/torch oracles: greedy, temperature, filters, penalties,
seeds and logprobs (`sample_rows`, the dynamic row count and chunked logits: test_sample_rows.py).

Random rows are checked in two ways: with real seeds (frequencies against softmax), and with the
row's uniform set directly (`dataclasses.replace(t, uniforms=...)`): sweeping it over a fine grid
must reach every kept token and nothing else, which pins down the kept set exactly.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxllm.layers.sampler import process_logits, sample
from jaxllm.sequence import SamplingTensors, draw_uniforms, warmup_tensors
from jaxllm.sampling_params import SamplingParams
from jaxllm.sequence import Sequence

S, V, EOS = 16, 8192, 7  # S = two chunks of the sampler's 8-row lax.map
_sample = jax.jit(sample)
_process = jax.jit(process_logits)


def req(prompt=(1, 2, 3), out=(), seed=0, **kw):
    return Sequence(f"r{seed}", list(prompt), SamplingParams(**kw), eos_token_ids=frozenset({EOS}),
                    seed=seed, output_token_ids=list(out))


def tensors(requests, vocab=V):
    return SamplingTensors.from_seqs(requests, S, vocab, max_logprobs=5, penalty_width=64)


def rand_logits(seed, rows=S, vocab=V, scale=2.0):
    return np.random.default_rng(seed).normal(size=(rows, vocab)).astype(np.float32) * scale


def reached(row_logits, params, n_u=1024):
    """Tokens drawn for one row over a uniform grid of n_u draws (S rows per call)."""
    logits = jnp.asarray(np.tile(row_logits, (S, 1)))
    t = tensors([req(**params)] * S)
    us = (np.arange(n_u, dtype=np.float64) + 0.5) / n_u
    out = set()
    for i in range(0, n_u, S):
        t = dataclasses.replace(t, uniforms=us[i:i + S].astype(np.float32))
        out |= set(np.asarray(_sample(logits, t).token_ids).tolist())
    return out


def survivors(x, temperature=1.0, top_k=0, min_p=0.0, **_):
    """vLLM's temperature, min_p, then top_k (value threshold), in float64; dropped = -inf."""
    s = x.astype(np.float64) / temperature
    p = np.exp(s - s.max())
    s = np.where(p < min_p * p.max(), -np.inf, s)
    if top_k:
        s = np.where(s < np.sort(s)[len(s) - top_k], -np.inf, s)
    return s


def vllm_kept(x, top_p=1.0, **params):
    """The tokens vLLM's apply_top_k_top_p keeps (ascending sort, cumsum <= 1 - p dropped)."""
    s = survivors(x, **params)
    order = np.argsort(s, kind="stable")
    q = np.exp(s[order] - s.max())
    drop = np.cumsum(q / q.sum()) <= 1 - top_p
    drop[-1] = False
    return set(order[~drop & np.isfinite(s[order])].tolist())


def cut_between(x, n, **params):
    """A top_p midway between keeping the top n and the top n+1 of the survivors."""
    s = np.sort(survivors(x, **params))[::-1]
    q = np.exp(s - s[0])
    c = np.cumsum(q / q.sum())
    return float((c[n - 2] + c[n - 1]) / 2)


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_first_argmax_of_processed_logits():
    logits = rand_logits(0)
    logits[3, [100, 5000, 8000]] = 50.0  # ties: the first index wins, as np.argmax
    logits[4, V - 1] = 60.0
    out = _sample(jnp.asarray(logits), tensors([req(temperature=0.0)] * S))
    np.testing.assert_array_equal(np.asarray(out.token_ids), np.argmax(logits, -1))
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_rows_in_a_random_batch_and_top_k_1():
    logits = rand_logits(1)
    rs = [req(temperature=0.0), req(temperature=1.5, top_k=1, seed=3),
          req(temperature=1e-6), req(temperature=0.8, top_k=1, top_p=0.5, seed=4)]
    for step in range(3):
        t = tensors([dataclasses.replace(r, output_token_ids=[0] * step) for r in rs])
        tok = np.asarray(_sample(jnp.asarray(logits), t).token_ids)
        np.testing.assert_array_equal(tok, np.argmax(logits, -1))


def test_vocab_not_a_multiple_of_the_block():
    vocab = 1000
    logits = rand_logits(2, vocab=vocab)
    logits[:, vocab - 1] = 40.0
    t = SamplingTensors.from_seqs([req(temperature=0.0), req(temperature=1.0, seed=1),
                                       req(temperature=1.0, top_p=0.9, seed=2, logprobs=3)],
                                      S, vocab, max_logprobs=5, penalty_width=8)
    out = _sample(jnp.asarray(logits), t)
    np.testing.assert_array_equal(np.asarray(out.token_ids), np.full(S, vocab - 1))
    np.testing.assert_array_equal(np.asarray(out.top_token_ids)[:, 0], np.full(S, vocab - 1))


# ----------------------------------------------------------------------------- random


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    ids = np.array([3, 900, 901, 4100, 8191])
    row = np.full(V, -40.0, np.float32)
    row[ids] = [1.0, 0.5, 0.0, -0.5, -1.0]
    logits = jnp.asarray(np.tile(row, (S, 1)))
    n = 4000
    counts = np.zeros(len(ids))
    for i in range(0, n, S):
        t = tensors([req(temperature=temperature, seed=1000 + i + j) for j in range(S)])
        counts += (np.asarray(_sample(logits, t).token_ids)[:, None] == ids).sum(0)
    assert counts.sum() == n  # nothing outside the five tokens
    p = np.exp(row[ids] / temperature)
    p /= p.sum()
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum()
    assert chi2 < 23.5  # 4 dof, P(chi2 > 23.5) = 1e-4


def test_uniform_grid_reaches_exactly_the_support():
    row = np.full(V, -np.inf, np.float32)
    row[[10, 2000, 7000]] = [0.0, -1.0, 1.0]
    assert reached(row, dict(temperature=1.0), n_u=64) == {10, 2000, 7000}


def test_draw_uniform_is_uniform_and_seeded():
    u = draw_uniforms(list(range(20000)), [0] * 20000)
    a, b, c, d, e = draw_uniforms([5, 5, 5, -1, 2 ** 64 - 1], [3, 3, 4, 0, 0])
    assert a == b != c and d == e
    assert 0.0 <= u.min() and u.max() < 1.0
    hist = np.histogram(u, bins=20, range=(0, 1))[0]
    assert ((hist - 1000) ** 2 / 1000).sum() < 50.8  # 19 dof, P(chi2 > 50.8) = 1e-4


FILTER_CASES = [
    dict(top_k=5),
    dict(top_k=40, temperature=0.7),
    dict(min_p=0.3),
    dict(top_p="cut6"),
    dict(top_p="cut20", temperature=1.3),
    dict(top_k=30, top_p="cut12", min_p=0.02, temperature=0.9),
]


def with_cut(row, case):
    """Params with "cutN" replaced by a top_p that keeps exactly N survivors."""
    params = {"temperature": 1.0, **case}
    if isinstance(case.get("top_p"), str):
        rest = {k: v for k, v in params.items() if k != "top_p"}
        params["top_p"] = cut_between(row, int(case["top_p"][3:]), **rest)
    return params


@pytest.mark.parametrize("case", FILTER_CASES, ids=str)
def test_filters_keep_exactly_vllms_set(case):
    """Twelve well-separated head tokens over a -8 background; cuts within the candidates."""
    rng = np.random.default_rng(7)
    row = rng.normal(size=V).astype(np.float32) - 8.0
    head = rng.choice(V, 40, replace=False)
    row[head] = np.linspace(2.0, -1.0, 40, dtype=np.float32) + rng.normal(size=40) * 0.01
    params = with_cut(row, case)
    expected = vllm_kept(row, **params)
    assert 1 < len(expected) < 60
    assert reached(row, params, n_u=4096) == expected


@pytest.mark.parametrize("case", [dict(top_p="cut300"), dict(top_k=400),
                                  dict(top_k=600, top_p="cut350", temperature=0.8)], ids=str)
def test_filters_beyond_the_candidates_stay_exact(case):
    """Hundreds of near-equal tokens: the cut lies past the top-128 candidates (bisection path)."""
    rng = np.random.default_rng(8)
    row = np.full(V, -30.0, np.float32) + rng.normal(size=V).astype(np.float32)
    head = rng.choice(V, 1000, replace=False)
    row[head] = rng.uniform(-0.5, 0.5, 1000).astype(np.float32)
    params = with_cut(row, case)
    expected = vllm_kept(row, **params)
    assert len(expected) > 128
    assert reached(row, params, n_u=4096) == expected


def test_seeded_row_is_the_same_alone_or_in_any_batch():
    logits = rand_logits(3)
    target = dict(temperature=0.9, seed=1234)
    others = [req(temperature=1.0, seed=s, top_p=0.8) for s in range(S)]
    for step in range(4):
        out = [0] * step
        alone = tensors([req(out=out, **target)])
        tok_alone = np.asarray(_sample(jnp.asarray(logits[[5] * S]), alone).token_ids)[0]
        for pos in (0, 9, 15):
            rs = others.copy()
            rs[pos] = req(out=out, **target)
            batch_logits = logits.copy()
            batch_logits[pos] = logits[5]
            tok = np.asarray(_sample(jnp.asarray(batch_logits), tensors(rs)).token_ids)[pos]
            assert tok == tok_alone, (step, pos)


def test_seeded_rows_differ_between_steps_and_seeds():
    logits = jnp.asarray(np.tile(rand_logits(4, rows=1, scale=0.1), (S, 1)))
    toks = {int(np.asarray(_sample(logits, tensors([req(temperature=1.0, seed=s, out=[0] * k)
                                                   for s in range(S)])).token_ids)[i])
            for k in range(4) for i in range(S)}
    assert len(toks) > 55  # 64 draws from ~8192 near-equal tokens


# ----------------------------------------------------------------------------- processing


def expected_processed(x, r):
    """HF/OpenAI/vLLM rules in NumPy, in vLLM's order."""
    sp = r.sampling_params
    x = x.copy()
    if sp.allowed_token_ids is not None:
        keep = np.zeros(len(x), bool)
        keep[sp.allowed_token_ids] = True
        x[~keep] = -np.inf
    if len(r.output_token_ids) < sp.min_tokens:
        x[list(r.eos_token_ids | set(sp.stop_token_ids))] = -np.inf
    for t, b in (sp.logit_bias or {}).items():
        x[t] += np.float32(b)
    rp = np.float32(sp.repetition_penalty)
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
    counts = np.bincount(r.output_token_ids, minlength=len(x)).astype(np.float32)
    return (x - np.float32(sp.frequency_penalty) * counts
            - np.float32(sp.presence_penalty) * (counts > 0))


def test_penalties_bias_allowed_and_min_tokens_values():
    logits = rand_logits(5)
    logits[:, :20] = np.linspace(-3, 3, 20)  # penalised ids with both signs
    rs = [req(prompt=[1, 2, 3, 15], out=[3, 3, 16, 19, 3], repetition_penalty=1.3),
          req(out=[4, 4, 4, 18, 2], frequency_penalty=0.7, presence_penalty=-0.4),
          req(out=[9], logit_bias={9: 2.5, 100: -5.0, 8000: 1.0}),
          req(out=[5, 6], allowed_token_ids=[0, 5, 6, 7, 4000], repetition_penalty=0.8),
          req(out=[11], min_tokens=3, stop_token_ids=[12, 13]),
          req(out=[11, 12, 14], min_tokens=3, stop_token_ids=[12]),  # min_tokens reached
          req(prompt=[1, 2], out=[2, 19], repetition_penalty=1.2, frequency_penalty=0.5,
              presence_penalty=0.25, logit_bias={19: 1.0, 0: 3.0}, min_tokens=4, ignore_eos=True),
          req(temperature=0.0)]
    t = tensors(rs)
    assert t.needs_processing
    got = np.asarray(_process(jnp.asarray(logits), t))
    for i, r in enumerate(rs):
        np.testing.assert_allclose(got[i], expected_processed(logits[i], r), rtol=1e-6, atol=1e-6,
                                   err_msg=f"row {i}")
    assert np.isneginf(got[4, [EOS, 12, 13]]).all() and np.isneginf(got[6, EOS])  # even ignore_eos


def test_processing_drives_the_sampled_token():
    logits = rand_logits(6)
    logits[:, 42] = 30.0
    rs = [req(temperature=0.0, min_tokens=2, out=[1]),               # eos 7 masked
          req(temperature=0.0, logit_bias={500: 100.0}),
          req(temperature=1.0, allowed_token_ids=[10, 11, 12], seed=2),
          req(temperature=0.0, repetition_penalty=2.0, out=[42], prompt=[1]),
          req(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0, out=[42] * 8)]
    logits[0, EOS] = 40.0
    logits[3, 43], logits[4, 44] = 20.0, 20.0
    tok = np.asarray(_sample(jnp.asarray(logits), tensors(rs)).token_ids)
    assert tok[0] == 42 and tok[1] == 500 and tok[2] in {10, 11, 12}
    assert tok[3] == 43 and tok[4] == 44
    logits_allowed = logits[2:3].copy()
    assert reached(logits_allowed[0], dict(temperature=1.0, allowed_token_ids=[10, 11, 12]),
                   n_u=256) == {10, 11, 12}


def test_penalty_table_overflow_is_an_error():
    r = req(prompt=list(range(100)), repetition_penalty=1.1)
    with pytest.raises(ValueError, match="penalty_width=64"):
        tensors([r])


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    logits = rand_logits(9, scale=3.0)
    rs = [req(temperature=1.0, seed=s, logprobs=5, repetition_penalty=1.5, out=[1, 2],
              top_p=0.9) for s in range(S - 1)] + [req(temperature=0.0)]
    out = _sample(jnp.asarray(logits), tensors(rs))
    ref = torch.log_softmax(torch.from_numpy(logits), -1).numpy()
    tok = np.asarray(out.token_ids)
    rows = np.arange(S)
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[rows, tok], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.ranks), (ref >= ref[rows, tok][:, None]).sum(-1))
    top = torch.topk(torch.from_numpy(ref), 5)
    np.testing.assert_array_equal(np.asarray(out.top_token_ids), top.indices.numpy())
    np.testing.assert_allclose(np.asarray(out.top_logprobs), top.values.numpy(), atol=1e-5)


def test_logprobs_zero_gives_the_sampled_token_only():
    logits = rand_logits(10)
    out = _sample(jnp.asarray(logits), tensors([req(temperature=0.0, logprobs=0)]))
    assert out.top_logprobs.shape == (S, 5)  # bucketed to max_logprobs
    ref = torch.log_softmax(torch.from_numpy(logits), -1).numpy()
    assert np.asarray(out.ranks)[0] == 1
    np.testing.assert_allclose(np.asarray(out.logprobs)[0], ref[0].max(), atol=1e-5)


# ----------------------------------------------------------------------------- batch shape


def test_padded_rows_with_garbage_are_harmless():
    logits = rand_logits(11)
    logits[3:] = np.nan
    logits[2] = -np.inf
    rs = [req(temperature=0.0), req(temperature=1.0, top_p=0.5, seed=1)]
    good = np.asarray(_sample(jnp.asarray(logits), tensors(rs)).token_ids)
    clean = logits.copy()
    clean[2:] = 0.0
    np.testing.assert_array_equal(good[:2], np.asarray(_sample(jnp.asarray(clean),
                                                               tensors(rs)).token_ids)[:2])
    assert ((0 <= good) & (good < V)).all()


def test_warmup_covers_each_static_variant_once():
    variants = warmup_tensors(S, V, max_logprobs=5, penalty_width=64)
    ts = [t for _, t in variants]
    keys = {(t.all_greedy, t.needs_filters, t.needs_processing, t.num_logprobs) for t in ts}
    assert len(ts) == len(keys) == 12
    plain = {(t.all_greedy, t.needs_filters, t.needs_processing, t.num_logprobs)
             for p, t in variants if p}
    assert plain == {(True, False, False, None), (False, False, False, None)}
    real = tensors([req(temperature=0.7, top_p=0.9, presence_penalty=0.5, logprobs=2)])
    twin = [t for t in ts if (t.all_greedy, t.needs_filters, t.needs_processing,
                              t.num_logprobs) == (False, True, True, 5)][0]
    assert jax.tree.structure(twin) == jax.tree.structure(real)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(twin)] == \
           [(a.shape, a.dtype) for a in jax.tree.leaves(real)]


def test_bfloat16_logits_are_sampled_in_float32():
    logits = rand_logits(12)
    rs = [req(temperature=0.0, logprobs=1)]
    lo = jnp.asarray(logits, jnp.bfloat16)
    out = _sample(lo, tensors(rs))
    ref = torch.log_softmax(torch.tensor(np.asarray(lo.astype(jnp.float32))), -1).numpy()
    assert np.asarray(out.token_ids)[0] == ref[0].argmax()
    np.testing.assert_allclose(np.asarray(out.logprobs)[0], ref[0].max(), atol=1e-5)


# ----------------------------------------------------------------------------- sample_rows

def test_output_kind_spellings():
    """SamplingParams.output_kind is vLLM's RequestOutputKind, also given by name; anything
    else is refused by name (the engine's outputs per kind: tests/test_structured_engine.py)."""
    from jaxllm.sampling_params import RequestOutputKind as K, SamplingParams
    assert SamplingParams().output_kind is K.CUMULATIVE
    assert SamplingParams(output_kind="delta").output_kind is K.DELTA
    assert SamplingParams(output_kind=K.FINAL_ONLY).output_kind is K.FINAL_ONLY
    for kind in ("final", 7):
        with pytest.raises(ValueError, match="output_kind must be one of"):
            SamplingParams(output_kind=kind)
