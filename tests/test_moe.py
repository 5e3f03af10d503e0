"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers, and the
experts op against a per-token NumPy sum.

Parity as tests/test_models.py: float32, prompts of different lengths prefilled in one ragged
batch through the paged cache (block size 4), then 32 greedy decode steps together; every
step's logits within ATOL = 1e-4 of transformers and the 32 tokens identical.
"""

import numpy as np
import pytest

from test_models import (_prompts, assert_greedy_matches_transformers,
                         bf16_and_transformers_errors)

MOE_CASES = [
    pytest.param("mixtral", {}, id="mixtral-top2"),
    pytest.param("mixtral", {"num_experts_per_tok": 1}, id="mixtral-top1"),
    pytest.param("qwen2_moe", {}, id="qwen2moe-shared-mixed-dense"),
    pytest.param("qwen2_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2,
                               "mlp_only_layers": [], "norm_topk_prob": True},
                 id="qwen2moe-sparse-step2-norm"),
    pytest.param("qwen3_moe", {}, id="qwen3moe-qknorm-top2"),
    pytest.param("qwen3_moe", {"num_experts_per_tok": 3, "norm_topk_prob": False},
                 id="qwen3moe-top3-unnormed"),
]


@pytest.mark.parametrize("arch,overrides", MOE_CASES)
def test_moe_matches_transformers(arch, overrides, make_tiny_checkpoint, load, greedy):
    from jaxllm.models.decoder import layer_groups

    path = make_tiny_checkpoint(arch, **overrides)
    model, cfg, _ = load(path)
    kinds = [g.kind for g in layer_groups(cfg)]
    if arch == "qwen2_moe":  # mlp_only_layers / decoder_sparse_step make dense layers
        assert kinds == (["moe", "dense", "moe"] if not overrides
                         else ["dense", "moe", "dense", "moe"])
    else:
        assert kinds == ["moe"]
    assert_greedy_matches_transformers(path, model, _prompts((5, 17, 30, 2)), greedy)


def _numpy_experts(x, ids, weights, w_gate_up, w_down):
    """The routed sum token by token, expert by expert (SiLU gate)."""
    out = np.zeros_like(x, dtype=np.float64)
    X = w_gate_up.shape[0]
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], weights[t]):
            if not 0 <= e < X:
                continue
            g, u = np.einsum("e,egf->gf", x[t], w_gate_up[e])
            out[t] += wt * ((g / (1 + np.exp(-g)) * u) @ w_down[e])
    return out


@pytest.mark.parametrize("impl", ["ragged", "dense", "loop", "gather", "tiled"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_expert_impls_match_numpy(impl, tokens):
    """Every implementation gives the per-token sum; expert 3 receives no token, and ids
    outside [0, X) (another device's experts under expert parallelism) count for nothing."""
    import jax
    import jax.numpy as jnp

    from jaxllm.layers.experts import EXPERT_IMPLS
    from pallas_kernels.activation.reference import silu_and_mul

    rng = np.random.default_rng(tokens)
    X, E, F = 6, 16, 12
    x = rng.normal(size=(tokens, E)).astype(np.float32)
    local, other = [0, 1, 2, 4, 5], [-1, 6, 9]  # never 3; -1, 6 and 9 are not local experts
    ids = np.stack([[a, rng.choice([e for e in local + other if e != a])]
                    for a in rng.choice(local, tokens)]).astype(np.int32)
    weights = rng.random((tokens, 2)).astype(np.float32)
    w_gate_up = (rng.normal(size=(X, E, 2, F)) / 2).astype(np.float32)
    w_down = (rng.normal(size=(X, F, E)) / 2).astype(np.float32)
    got = jax.jit(lambda *a: EXPERT_IMPLS[impl](*a, lambda gu: silu_and_mul(gu, jnp.float32)))(
        x, ids, weights, w_gate_up, w_down)
    want = _numpy_experts(x, ids, weights, w_gate_up, w_down)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("experts", [8, 2 ** 28])  # the second overflows the int32 keys
def test_expert_order_is_the_stable_argsort(experts):
    """The routed pairs' order (sorted by expert, ties in pair order: what keeps a row's bits
    independent of the batch) is argsort(stable=True)'s, with the experts of no device (id
    `experts`) last, whichever way it is computed."""
    import jax.numpy as jnp

    from jaxllm.layers.experts import stable_order

    rng = np.random.default_rng(experts % 97)
    flat = rng.integers(0, 9, 4096).astype(np.int32)  # few distinct ids: many ties
    flat[rng.random(4096) < 0.1] = experts  # not on this device
    flat = np.minimum(flat, experts)
    want = np.argsort(flat, kind="stable")
    got = np.asarray(stable_order(jnp.asarray(flat), experts))
    assert np.all(np.diff(flat[got]) >= 0)
    np.testing.assert_array_equal(got, want)


def test_megablox_grouped_matmul_matches_ragged_dot():
    """The Pallas backend's TPU grouped matmul (jax's megablox `gmm`, interpreted here) in the
    `ragged` experts gives ragged_dot's sum: rows padded to its tile, non-local rows zeroed."""
    import jax.numpy as jnp

    from jaxllm.layers.backends.pallas import megablox_gmm
    from jaxllm.layers.experts import experts_ragged
    from pallas_kernels.activation.reference import silu_and_mul

    rng = np.random.default_rng(0)
    T, k, X, E, F = 13, 2, 4, 64, 32
    x = rng.normal(size=(T, E)).astype(np.float32)
    ids = rng.integers(-1, 5, (T, k)).astype(np.int32)  # -1 and 4: not local experts
    w = rng.random((T, k)).astype(np.float32)
    gu = (rng.normal(size=(X, E, 2, F)) / 8).astype(np.float32)
    down = (rng.normal(size=(X, F, E)) / 8).astype(np.float32)
    act = lambda g: silu_and_mul(g, jnp.float32)  # noqa: E731
    want = experts_ragged(x, ids, w, gu, down, act)
    got = experts_ragged(x, ids, w, gu, down, act, lambda *a: megablox_gmm(*a, interpret=True))
    assert np.abs(np.asarray(want)).max() > 0.1
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_moe_impl_choice_on_cpu():
    """On XLA:CPU few tokens gather their experts' weights; more run the per-expert loop in
    float32 and the all-experts einsum in bf16; many (64 rows per expert on average) the tiled
    grouped matmul (see `ReferenceBackend.moe_impl`)."""
    from jaxllm.layers.backends.reference import ReferenceBackend

    b = ReferenceBackend()
    assert b.moe_impl(1, 2, 8, "float32") == "gather"
    assert b.moe_impl(4, 8, 128, "bfloat16") == "gather"
    assert b.moe_impl(64, 2, 8, "float32") == "loop"
    assert b.moe_impl(64, 2, 8, "bfloat16") == "dense"
    assert b.moe_impl(256, 2, 8, "bfloat16") == "tiled"
    assert b.moe_impl(2048, 8, 128, "float32") == "tiled"


def test_missing_expert_is_named(make_tiny_checkpoint, load, tmp_path):
    """A checkpoint without one expert's tensor fails naming that tensor."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxllm.loader.weights import CheckpointError

    src = make_tiny_checkpoint("qwen3_moe")
    dst = tmp_path / "missing"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    gone = "model.layers.1.mlp.experts.5.up_proj.weight"
    del tensors[gone]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        load(str(dst))


def test_expert_parallel_refused_for_dense_models(tiny_llama, load):
    from jaxllm.config import ConfigError

    with pytest.raises(ConfigError, match="--enable-expert-parallel"):
        load(tiny_llama, enable_expert_parallel=True)



@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_moe_bfloat16_error_is_transformers_bfloat16_error(make_tiny_checkpoint, load, greedy,
                                                         backend):
    """bfloat16 (the CPU backend's grouped matmul, the reference's all-experts einsum; the
    weights stored as bits) strays from float32 transformers no more than transformers' own
    bfloat16 does. Fixed weights: with other random weights, a router near-tie that bf16 rounding flips (differently in each
    implementation) sends a token to another expert and both errors jump (seen: 0.67 against
    transformers' 0.15)."""
    path = make_tiny_checkpoint("qwen2_moe", seed=0)
    model, cfg, _ = load(path, dtype="bfloat16", attention_backend=backend)
    assert model.backend.name == backend
    prompts = _prompts((5, 17, 30))
    prefill, _, _ = greedy(model, prompts, 1)
    for err, their_err in bf16_and_transformers_errors(path, prefill, prompts):
        assert err.max() <= 1.5 * their_err.max() + 0.02


def test_moe_tiled_prefill_matches_transformers(make_tiny_checkpoint, load, greedy):
    """A prefill of 512 padded tokens (>= 64 rows per expert) runs the `tiled` grouped matmul
    on CPU; it matches transformers as the other implementations do."""
    from jaxllm.layers.backends.reference import ReferenceBackend

    path = make_tiny_checkpoint("mixtral")
    model, cfg, _ = load(path)
    prompts = _prompts((120, 100, 60))
    assert ReferenceBackend().moe_impl(512, 2, cfg.num_experts, "float32") == "tiled"
    assert_greedy_matches_transformers(path, model, prompts, greedy)
