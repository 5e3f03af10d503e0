"""Qwen3-Next with the Pallas backend: its step (the platform's attention and gated DeltaNet
kernels inside) exports for TPU and CUDA from this CPU host, on one device and on a 2-way
tensor-parallel mesh (the DeltaNet kernels per shard of heads); and on CPU (the GPU kernels
interpreted) it gives transformers' greedy tokens."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from jaxllm.config import EngineArgs
from jaxllm.layers.attention import KV_CACHE_AXES, AttentionMetadata, KVCache
from jaxllm.layers.backends.pallas import PallasBackend
from jaxllm.models.decoder import abstract_decoder
from jaxllm.models.model_config import ModelConfig
from jaxllm.parallel.mesh import MESH_AXES, logical_to_spec
from qwen3_next_checkpoints import DENSE, make_qwen3_next
from test_export import CPU_ONLY, KERNEL, UNCHECKED

S, T, NUM_BLOCKS, BLOCK, TABLE = 3, 16, 16, 16, 4  # 3 chunks: no power of 2


def hybrid_config() -> ModelConfig:
    from transformers import Qwen3NextConfig
    hf = Qwen3NextConfig(**{**DENSE, "linear_key_head_dim": 16, "linear_value_head_dim": 16})
    hf.architectures = ["Qwen3NextForCausalLM"]
    return ModelConfig.from_hf(hf, EngineArgs(model="tiny", dtype="bfloat16")
                               .create_engine_config().model)


def exported_step(platform: str, tp: int, decode_only: bool) -> export.Exported:
    cfg = hybrid_config()
    mesh = AbstractMesh((1, tp, 1), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    model = abstract_decoder(cfg, PallasBackend(mesh if tp > 1 else None))
    graphdef, state = nnx.split(model)

    def step(state, caches, ids, positions, md):
        m = nnx.merge(graphdef, state)
        hidden, caches = m(caches, ids, positions, md)
        return m.compute_logits(hidden), caches

    def arg(shape, dtype, axes=None):
        axes = axes or (None,) * len(shape)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
            mesh, logical_to_spec(axes, shape, mesh)))

    params = jax.tree.map(lambda v: arg(v.shape, v.dtype, v.get_metadata()["out_sharding"]),
                          state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    caches = tuple(KVCache(*[arg(s, cfg.jnp_dtype, KV_CACHE_AXES)
                             for s in (pair if isinstance(pair, KVCache) else (pair, pair))])
                   for pair in model.kv_cache_shapes(NUM_BLOCKS, BLOCK, state_slots=S))
    i32 = lambda *shape: arg(shape, jnp.int32)  # noqa: E731
    tokens = S if decode_only else T
    md = AttentionMetadata(i32(tokens), i32(S), i32(S, TABLE), i32(S + 1), i32(1),
                           decode_only=decode_only, state_slots=i32(S))
    return export.export(jax.jit(step, donate_argnums=1), platforms=(platform,),
                         disabled_checks=UNCHECKED)(params, caches, i32(tokens), i32(tokens), md)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # ~6 s each
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_step_exports_with_the_delta_rule_kernels(platform, tp):
    """A mixed step holds the chunked and the recurrent kernel (the step picks one at run
    time), a decode step the recurrent one alone; beside them the attention kernel."""
    for decode_only, kernels in ((False, {"chunked_kernel", "recurrent_kernel"}),
                                 (True, {"recurrent_kernel"})):
        exported = exported_step(platform, tp, decode_only)
        text = exported.mlir_module()
        assert exported.platforms == (platform,) and exported.nr_devices == tp
        assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {KERNEL[platform]}
        assert not [name for name in CPU_ONLY if name in text]
        found = {name for name in ("chunked_kernel", "recurrent_kernel") if name in text}
        assert found == kernels, (decode_only, found)
        if tp > 1:  # the state arrives split by value heads; the kernels run per shard
            assert '{"model"}' in text and "sdy.manual_computation" in text


@pytest.fixture(scope="module")
def qwen3_next(make_tiny_checkpoint, tmp_path_factory):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(make_tiny_checkpoint("llama"))
    return make_qwen3_next(tmp_path_factory, tok, {})


@pytest.mark.slow  # the Pallas kernels interpreted on CPU, a model's worth of them (~1 min)
def test_pallas_backend_matches_transformers(qwen3_next, load):
    """Ragged prefill across chunk boundaries (and a length-1 prompt), then greedy decode with
    the Pallas backend (the GPU variants interpreted): transformers' tokens and logits."""
    from test_qwen3_next import ATOL, _hf, _hf_greedy, _prompts
    from qwen3_next_checkpoints import StateRunner

    path = qwen3_next
    model, _, _ = load(path, attention_backend="pallas")
    assert isinstance(model.backend, PallasBackend)
    prompts = _prompts((5, 1, 70))
    runner = StateRunner(model, 4, len(prompts), 128, 128)
    seqs = list(range(len(prompts)))
    prefill = runner.step(seqs, prompts)
    last = [int(p[-1].argmax()) for p in prefill]
    tokens, steps = [[t] for t in last], [[] for _ in prompts]
    for _ in range(8):
        out = runner.step(seqs, [[t] for t in last])
        last = [int(o[0].argmax()) for o in out]
        for i, o in enumerate(out):
            steps[i].append(o[0])
            tokens[i].append(last[i])
    hf = _hf(path)
    for i, prompt in enumerate(prompts):
        want_prefill, want_steps, want_tokens = _hf_greedy(hf, prompt, 9)
        np.testing.assert_allclose(prefill[i], want_prefill, atol=ATOL, rtol=0)
        np.testing.assert_allclose(np.stack(steps[i]), want_steps[:8], atol=ATOL, rtol=0)
        assert tokens[i] == want_tokens
