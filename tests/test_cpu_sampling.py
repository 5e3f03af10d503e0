"""The native plain draw (pallas_kernels/sampling/kernel_cpu.cc) against its pure-JAX reference
and a float64 oracle, and inside `sample_rows` against the sampler's XLA path.

Sums in float32 and a different exp may make a draw differ from the oracle only where the row's
uniform lies within rounding of a token's CDF edge: such a row is excused, counted, and must be
rare; every other row must give exactly the oracle's token.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.sampler import sample_rows
from jaxllm.sequence import SamplingTensors
from jaxllm.sampling_params import SamplingParams
from jaxllm.sequence import Sequence
from pallas_kernels.sampling import kernel_cpu, reference

_kernel = jax.jit(kernel_cpu.draw)
_reference = jax.jit(reference.draw)
EDGE = 2e-6  # a uniform this close to a CDF edge (as a fraction of the kept mass) is excused


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernel_cpu.available(), "the CPU sampling kernel did not build (see the log)"


def oracle(x, temperature, min_p, u):
    """float64 inverse CDF over the kept tokens: (token, distance from u to the nearest edge)."""
    s = x.astype(np.float64) / temperature
    p = np.exp(s - s.max())
    p = np.where(p >= min_p, p, 0.0)  # min_p * p_max, p_max = 1
    c = np.cumsum(p) / p.sum()
    token = int(np.argmax((c > u) & (p > 0)))
    return token, float(np.min(np.abs(c[p > 0] - u)))


def rows(seed, n, vocab):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, vocab)) * rng.uniform(0.5, 4, (n, 1))).astype(np.float32)
    temperature = rng.choice([0.05, 0.3, 0.7, 1.0, 1.6], n).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.02, 0.3], n).astype(np.float32)
    u = rng.random(n).astype(np.float32)
    u[:4] = [0.0, np.float32(1 - 2 ** -24), 0.5, 1e-7]
    return x, temperature, min_p, u


@pytest.mark.parametrize("vocab", [1000 + 13, 32000])
def test_draw_is_the_oracles_token_away_from_cdf_edges(vocab):
    n = 96
    x, temperature, min_p, u = rows(vocab, n, vocab)
    greedy = np.zeros(n, bool)
    got = np.asarray(_kernel(x, temperature, min_p, u, greedy))
    ref = np.asarray(_reference(x, temperature, min_p, u, greedy))
    excused = 0
    for i in range(n):
        want, edge = oracle(x[i], temperature[i], min_p[i], u[i])
        if got[i] != want or ref[i] != want:
            assert edge < EDGE, (i, got[i], ref[i], want, temperature[i], min_p[i], u[i])
            excused += 1
    assert excused <= 2, f"{excused} of {n} rows differ from the oracle"


def test_uniform_zero_takes_the_first_kept_token_not_a_vanishing_one():
    """Tokens whose weight underflows are never drawn, even by u = 0 (the kernel's exp stops at
    -87, where the true weight is below 1.7e-38)."""
    x = np.full((2, 640), -200.0, np.float32)
    x[:, 300] = 0.0
    x[:, 517] = -0.5
    got = np.asarray(_kernel(x, np.ones(2, np.float32), np.zeros(2, np.float32),
                             np.array([0.0, 0.99999], np.float32), np.zeros(2, bool)))
    assert got.tolist() == [300, 517]


def test_min_p_keeps_exactly_the_tokens_above_its_share():
    rng = np.random.default_rng(3)
    row = (rng.normal(size=512) * 2).astype(np.float32)
    n_u = 2048
    x = np.tile(row, (n_u, 1))
    u = ((np.arange(n_u) + 0.5) / n_u).astype(np.float32)
    for min_p in (0.05, 0.5):
        got = set(np.asarray(_kernel(x, np.full(n_u, 0.8, np.float32),
                                     np.full(n_u, min_p, np.float32), u,
                                     np.zeros(n_u, bool))).tolist())
        p = np.exp((row.astype(np.float64) - row.max()) / 0.8)
        kept = set(np.flatnonzero(p >= min_p).tolist())
        assert got <= kept
        assert {t for t in kept if p[t] / p[list(kept)].sum() > 4 / n_u} <= got


def test_greedy_rows_take_the_first_maximum_and_rows_not_live_are_not_read():
    x = np.random.default_rng(4).normal(size=(6, 300)).astype(np.float32)
    x[0, [7, 200]] = 9.0  # a tie: the first wins
    x[3] = np.nan  # not live: never read
    greedy = np.array([True, True, False, False, True, False])
    live = np.array([True, True, True, False, True, True])
    one = np.ones(6, np.float32)
    got = np.asarray(jax.jit(kernel_cpu.draw)(x, one, one * 0, one * 0.5, greedy, live))
    assert got[0] == 7 and got[1] == int(np.argmax(x[1])) and got[4] == int(np.argmax(x[4]))
    assert got[3] == 0
    ref = np.asarray(_reference(x, one, one * 0, one * 0.5, greedy))
    assert got[[0, 1, 2, 4, 5]].tolist() == ref[[0, 1, 2, 4, 5]].tolist()


SR, V = 80, 4096


def test_sample_rows_with_the_draw_equals_the_xla_sampler():
    """Plain random steps (temperature, min_p, some greedy rows) sample through the draw and give
    the XLA path's tokens; steps the draw cannot serve (top_p) never call it."""
    calls = []

    def draw(*args):
        jax.debug.callback(lambda: calls.append(1))
        return kernel_cpu.draw(*args)

    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(
        temperature=0.0 if i % 5 == 0 else 0.5 + i % 3, min_p=0.1 if i % 4 == 0 else 0.0),
        eos_token_ids=frozenset({2}), seed=i) for i in range(SR)]
    t = SamplingTensors.from_seqs(seqs, SR, V, max_logprobs=5, penalty_width=64)
    assert not (t.needs_filters or t.needs_processing or t.all_greedy)
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(SR, V)).astype(np.float32) * 3)
    native = jax.jit(lambda h, n, t: sample_rows(h, n, lambda x: x, t, draw=draw))
    xla = jax.jit(lambda h, n, t: sample_rows(h, n, lambda x: x, t))
    excused = 0
    for n in (1, 17, SR):
        got = np.asarray(native(logits, np.int32(n), t).token_ids)[:n]
        want = np.asarray(xla(logits, np.int32(n), t).token_ids)[:n]
        for i in np.flatnonzero(got != want):
            _, edge = oracle(np.asarray(logits[i]), float(t.temperature[i]), float(t.min_p[i]),
                             float(t.uniforms[i]))
            assert edge < EDGE, (n, i, got[i], want[i])
            excused += 1
    assert excused <= 1
    jax.effects_barrier()
    assert calls, "the draw did not run"
    calls.clear()
    filtered = dataclasses.replace(t, needs_filters=True)
    jax.block_until_ready(native(logits, np.int32(5), filtered))
    jax.effects_barrier()
    assert not calls, "a step with top_p/top_k went through the draw"
