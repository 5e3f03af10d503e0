"""The pure-JAX gated DeltaNet reference (pallas_kernels/gated_delta_rule/reference.py) against
transformers' PyTorch implementation of the delta rule and the causal convolution (Qwen3-Next):
ragged batches with chunk boundaries, length-1 sequences, states carried in slots (chunked
prefill, decode) and decays near 0 and 1."""

import numpy as np
import pytest
import torch
import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule import reference as ref

qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

HK, HV, DK, DV, W = 2, 4, 8, 6, 4
TOL = dict(rtol=2e-4, atol=2e-5)
# Jitted once per shape (the tests share shapes where they can: compiles dominate their cost).
chunked = jax.jit(ref.gated_delta_rule_chunked, static_argnames="chunk")
recurrent = jax.jit(ref.gated_delta_rule_recurrent)
conv1d = jax.jit(ref.causal_conv1d, static_argnames="activation")


def inputs(rng, T, g_scale=1.0, g_shift=0.0):
    q = rng.standard_normal((T, HK, DK)).astype(np.float32)
    k = rng.standard_normal((T, HK, DK)).astype(np.float32)
    v = rng.standard_normal((T, HV, DV)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((T, HV))) * g_scale + g_shift).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, HV))))).astype(np.float32)
    return q, k, v, g, beta


def torch_rule(q, k, v, g, beta, state=None, recurrent=False):
    """transformers' chunked (or recurrent) delta rule over one sequence -> (out, state)."""
    t = [torch.from_numpy(np.ascontiguousarray(a))[None] for a in (q, k, v, g, beta)]
    init = None if state is None else torch.from_numpy(np.asarray(state))[None]
    fn = qn.torch_recurrent_gated_delta_rule if recurrent else qn.torch_chunk_gated_delta_rule
    o, s = fn(*t, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0].numpy(), s[0].numpy()


def pack(lens, T, S):
    cu = np.zeros(S + 1, np.int32)
    cu[1:len(lens) + 1] = np.cumsum(lens)
    cu[len(lens) + 1:] = cu[len(lens)]
    assert cu[-1] <= T
    return jnp.asarray(cu), jnp.asarray([len(lens)], jnp.int32)


def run_chunked(q, k, v, g, beta, state, slots, fresh, cu, ns, chunk=ref.CHUNK):
    return chunked(*map(jnp.asarray, (q, k, v, g, beta, state)),
                                        jnp.asarray(slots, jnp.int32), jnp.asarray(fresh),
                                        cu, ns, chunk=chunk)


@pytest.mark.parametrize("lens", [(1,), (64,), (65, 1, 130), (63, 200, 5)])
def test_chunked_ragged_from_zero_matches_transformers(lens):
    rng = np.random.default_rng(sum(lens))
    S, T = 4, 280        # padding sequences and padding rows
    q, k, v, g, beta = inputs(rng, T)
    N = 5
    state0 = rng.standard_normal((N, HV, DK, DV)).astype(np.float32)  # stale slot contents
    slots = ([3, 0, 4][:len(lens)] + [-1] * 3)[:S]
    cu, ns = pack(lens, T, S)
    out, state = run_chunked(q, k, v, g, beta, state0, slots, [True] * S, cu, ns)
    out, state = np.asarray(out), np.asarray(state)
    c = np.asarray(cu)
    for i, n in enumerate(lens):
        a, b = c[i], c[i + 1]
        o_t, s_t = torch_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b])
        np.testing.assert_allclose(out[a:b], o_t, **TOL)
        np.testing.assert_allclose(state[slots[i]], s_t, **TOL)
    assert np.all(out[c[len(lens)]:] == 0)
    untouched = [s for s in range(N) if s not in slots]
    np.testing.assert_array_equal(state[untouched], state0[untouched])


def test_chunked_continues_from_slot_state():
    """A prompt split at arbitrary points over steps (chunked prefill) equals the whole."""
    rng = np.random.default_rng(7)
    T = 150
    q, k, v, g, beta = inputs(rng, T)
    o_all, s_all = torch_rule(q, k, v, g, beta)
    state = np.zeros((2, HV, DK, DV), np.float32)
    outs = []
    for a, b in [(0, 37), (37, 38), (38, 140), (140, 150)]:
        cu, ns = pack([b - a], 128, 2)
        pad = lambda x: np.concatenate([x[a:b], np.zeros((128 - (b - a),) + x.shape[1:],
                                                          x.dtype)])  # noqa: E731
        out, state = run_chunked(*(pad(x) for x in (q, k, v, g, beta)), state, [1, -1],
                                 [a == 0, True], cu, ns)
        outs.append(np.asarray(out)[:b - a])
    np.testing.assert_allclose(np.concatenate(outs), o_all, **TOL)
    np.testing.assert_allclose(np.asarray(state)[1], s_all, **TOL)


@pytest.mark.parametrize("g_scale,g_shift", [(1e-4, 0.0), (0.0, -30.0), (1.0, 0.0)],
                         ids=["decay~1", "decay~0", "mixed"])
def test_recurrent_decode_and_decays(g_scale, g_shift):
    """Prefill (chunked) then decode steps (recurrent) for two sequences in one batch equal
    transformers' recurrent rule over the whole sequences; decays near 1 and near 0."""
    rng = np.random.default_rng(3)
    lens, steps = (70, 1), 4
    total = [n + steps for n in lens]
    seqs = [inputs(rng, n, g_scale, g_shift) for n in total]
    T = 80
    parts = [np.concatenate([s[j][:n] for s, n in zip(seqs, lens)]) for j in range(5)]
    parts = [np.concatenate([p, np.zeros((T - len(p),) + p.shape[1:], p.dtype)]) for p in parts]
    cu, ns = pack(lens, T, 3)
    state = np.zeros((3, HV, DK, DV), np.float32)
    out, state = run_chunked(*parts, state, [2, 0, -1], [True, True, True], cu, ns)
    outs = [[np.asarray(out)[:70]], [np.asarray(out)[70:71]]]
    for i in range(steps):
        rows = [np.stack([s[j][n + i] for s, n in zip(seqs, lens)] + [seqs[0][j][0] * 0])
                for j in range(5)]  # one padding row
        cu, ns = pack([1, 1], 3, 3)
        out, state = recurrent(*map(jnp.asarray, rows), jnp.asarray(state),
                                                    jnp.asarray([2, 0, -1], jnp.int32),
                                                    jnp.asarray([False] * 3), cu, ns)
        outs[0].append(np.asarray(out)[:1])
        outs[1].append(np.asarray(out)[1:2])
    for i, s in enumerate(seqs):
        o_t, s_t = torch_rule(*s, recurrent=True)
        np.testing.assert_allclose(np.concatenate(outs[i]), o_t, **TOL)
        np.testing.assert_allclose(np.asarray(state)[[2, 0][i]], s_t, **TOL)


def test_conv1d_ragged_and_carried_state():
    """The causal convolution over a ragged batch from zero states equals transformers'
    causal_conv1d_fn per sequence; continued from the slots (decode with causal_conv1d_update,
    and a later prompt chunk) it equals the convolution over the whole sequence."""
    rng = np.random.default_rng(11)
    C = 10
    w = rng.standard_normal((C, W)).astype(np.float32)
    lens = (1, 6, 2)
    full = [rng.standard_normal((n + 5, C)).astype(np.float32) for n in lens]
    T, S, N = 12, 4, 4
    x = np.zeros((T, C), np.float32)
    x[:sum(lens)] = np.concatenate([f[:n] for f, n in zip(full, lens)])
    cu, ns = pack(lens, T, S)
    slots = jnp.asarray([1, 3, 0, -1], jnp.int32)
    st0 = jnp.asarray(rng.standard_normal((N, C, W - 1)).astype(np.float32))
    out, st = conv1d(jnp.asarray(x), jnp.asarray(w), st0, slots,
                                jnp.asarray([True] * S), cu, ns)
    tw = torch.from_numpy(w)
    c = np.asarray(cu)
    for i, f in enumerate(full):
        whole = qn.causal_conv1d_fn(torch.from_numpy(f.T.copy())[None], tw,
                                    activation="silu")[0].T.numpy()
        np.testing.assert_allclose(np.asarray(out)[c[i]:c[i + 1]], whole[:lens[i]], **TOL)
        # Continue: one decode row, then the remaining 4 rows as a prompt chunk.
        cs = torch.zeros(1, C, W - 1)
        cs[0] = torch.from_numpy(np.asarray(st)[np.asarray(slots)[i]])
        dec = qn.causal_conv1d_update(torch.from_numpy(f[lens[i]:lens[i] + 1].T.copy())[None],
                                      cs, tw, activation="silu")[0].T.numpy()
        np.testing.assert_allclose(dec, whole[lens[i]:lens[i] + 1], **TOL)
        one = jnp.asarray(f[lens[i]:lens[i] + 1])
        cu1, ns1 = pack([1], 1, 1)
        o1, st1 = conv1d(one, jnp.asarray(w), st, slots[i:i + 1],
                                    jnp.asarray([False]), cu1, ns1)
        np.testing.assert_allclose(np.asarray(o1), dec, **TOL)
        cu4, ns4 = pack([4], 4, 1)
        o4, _ = conv1d(jnp.asarray(f[lens[i] + 1:]), jnp.asarray(w), st1,
                                  slots[i:i + 1], jnp.asarray([False]), cu4, ns4)
        np.testing.assert_allclose(np.asarray(o4), whole[lens[i] + 1:], **TOL)
    np.testing.assert_array_equal(np.asarray(st)[2], np.asarray(st0)[2])  # no sequence's slot
