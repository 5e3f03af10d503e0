"""`sample_rows` (a dynamic row count, the logits computed in chunks) against `sample`: the
same tokens and logprobs for every row count, one compiled program for all of them, work that
scales with the rows asked for, and garbage past them ignored."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.sampler import LOGIT_ROWS, sample, sample_rows
from jaxllm.sequence import SamplingTensors
from test_sampler import V, rand_logits, req


SR = 2 * max(LOGIT_ROWS) + 8  # sample_rows' S: three steps at most, the last one clamped
_chunks = []  # the row count of every compute_logits call that actually ran


def _logits_are_rows(h):
    """compute_logits for these tests: the rows are the logits; records each run."""
    jax.debug.callback(lambda: _chunks.append(len(h)))
    return h


def sample_logit_rows(h, n, t):
    """sample_rows over rows that are the logits: the program these tests compile once."""
    return sample_rows(h, n, _logits_are_rows, t)


_sample_rows = jax.jit(sample_logit_rows)
_sample_sr = jax.jit(sample)


@pytest.fixture(scope="module")
def sample_rows_compiles():
    """Each XLA compilation of _sample_rows by this module's tests: whatever they vary (row
    counts, junk rows, requests) must hit one program. Seen through jax.monitoring's public
    compile event; were it renamed, none would be seen and the `== 1` checks would fail."""
    seen = []

    def listener(event, secs, fun_name=None, **_):
        if (event == "/jax/core/compile/backend_compile_duration"
                and fun_name == "jit(sample_logit_rows)"):
            seen.append(secs)
    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


def mixed_requests(n):
    """Every static feature on (filters, processing, logprobs); top_p=0.7 over rand_logits
    cuts past the candidates, so the bisection fallback runs too."""
    kinds = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.7),
             dict(temperature=1.1, top_k=20, logprobs=3),
             dict(temperature=0.7, min_p=0.1, repetition_penalty=1.2, out=[5, 6]),
             dict(temperature=0.0, logit_bias={17: 5.0}, logprobs=0)]
    return [req(seed=i, **kinds[i % len(kinds)]) for i in range(n)]


def tensors_sr(requests):
    return SamplingTensors.from_seqs(requests, SR, V, max_logprobs=5, penalty_width=64)


def test_sample_rows_equals_sample_and_compiles_once(sample_rows_compiles):
    logits = jnp.asarray(rand_logits(13, rows=SR))
    t = tensors_sr(mixed_requests(SR))
    assert t.needs_filters and t.needs_processing and t.num_logprobs and not t.all_greedy
    ref = _sample_sr(logits, t)
    for n in (1, 5, 16, 17, 65, SR):
        out = _sample_rows(logits, np.int32(n), t)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a)[:n], np.asarray(b)[:n], err_msg=f"n={n}")
    assert len(sample_rows_compiles) == 1


def test_sample_rows_ignores_rows_past_num_rows(sample_rows_compiles):
    n = 17
    logits = rand_logits(14, rows=SR)
    clean = _sample_rows(jnp.asarray(logits), np.int32(n), tensors_sr(mixed_requests(SR)))
    logits[n:] = np.nan
    logits[n + 1:] = np.inf
    junk = [req(temperature=1.0, top_p=0.3, seed=99, repetition_penalty=3.0, logprobs=5)]
    dirty = _sample_rows(jnp.asarray(logits), np.int32(n),
                         tensors_sr(mixed_requests(n) + junk * (SR - n)))
    for a, b in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean)):
        np.testing.assert_array_equal(np.asarray(a)[:n], np.asarray(b)[:n])
    assert len(sample_rows_compiles) == 1


def test_sample_rows_greedy_head_replaces_plain_greedy_sampling():
    """A greedy LM head (rows -> their first maxima) gives the tokens sampling the logits
    gives, and runs only when every row is greedy with nothing to process or report."""
    logits = jnp.asarray(rand_logits(15, rows=SR))
    heads = []

    def head(h):
        jax.debug.callback(lambda: heads.append(len(h)))
        return jnp.argmax(h, -1).astype(jnp.int32)

    f = jax.jit(lambda h, n, t: sample_rows(h, n, _logits_are_rows, t, greedy_head=head))
    sampled = jax.jit(lambda h, n, t: sample_rows(h, n, _logits_are_rows, t))
    greedy = tensors_sr([req(temperature=0.0, seed=i) for i in range(SR)])
    for n in (1, 17, SR):
        got, want = f(logits, np.int32(n), greedy), sampled(logits, np.int32(n), greedy)
        np.testing.assert_array_equal(np.asarray(got.token_ids)[:n],
                                      np.asarray(want.token_ids)[:n])
    jax.effects_barrier()
    assert heads, "the greedy head did not run"
    heads.clear()
    reported = tensors_sr([req(temperature=0.0, logprobs=1, seed=i) for i in range(SR)])
    jax.block_until_ready(f(logits, np.int32(5), reported))
    jax.effects_barrier()
    assert not heads, "logprobs need the logits"


def expected_chunks(n):
    """sample_rows' schedule: the smallest of LOGIT_ROWS covering the rows left, else the
    largest, clamped to end at SR."""
    sizes, done, out = sorted(LOGIT_ROWS), 0, []
    while done < n:
        c = next((c for c in sizes if c >= n - done), sizes[-1])
        out.append(c)
        done = min(done, SR - c) + c
    return out


def test_sample_rows_work_scales_with_num_rows(sample_rows_compiles):
    logits = jnp.asarray(rand_logits(15, rows=SR))
    t = tensors_sr(mixed_requests(SR))
    assert expected_chunks(1) == [min(LOGIT_ROWS)]
    for n in (0, 1, 2, 16, 17, 65, SR - 1, SR):
        _chunks.clear()
        jax.block_until_ready(_sample_rows(logits, np.int32(n), t))
        jax.effects_barrier()
        assert _chunks == expected_chunks(n), n
    assert len(sample_rows_compiles) == 1


def test_sample_rows_with_a_projection():
    """compute_logits gets [C, E] chunks of the hidden rows, in order."""
    rng = np.random.default_rng(16)
    w = rng.normal(size=(V, 256)).astype(np.float32)
    target = rng.integers(0, V, SR)
    hidden = w[target]  # logit ~256 at the target, ~N(0, 16^2) elsewhere
    f = jax.jit(lambda w, h, n, t: sample_rows(h, n, lambda x: x @ w.T, t))
    t = tensors_sr([req(temperature=0.0)] * SR)
    for n in (3, SR):
        tok = np.asarray(f(w, hidden, np.int32(n), t).token_ids)
        np.testing.assert_array_equal(tok[:n], target[:n])
