"""The accelerator programs, checked without an accelerator.

The whole step the runner jits (the forward with the `pallas` backend, then the sampler over
the hidden rows it samples) is exported with `jax.export` for TPU and for CUDA from this CPU
host, on one device and on a 2-way tensor-parallel mesh (an `AbstractMesh`: no devices needed).
Exporting lowers the program for that platform; the test then checks what reached it: the
platform's attention kernel, and no CPU-only custom call (the native kernels' FFI targets, host
callbacks). The step is composed here from the same public pieces the runner's `_forward_fn` and
`_sample_fn` compose, since the runner itself needs real devices for its caches.
"""

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
from jaxllm.layers.sampler import sample_rows
from jaxllm.sequence import warmup_tensors
from jaxllm.models.decoder import abstract_decoder
from jaxllm.models.model_config import ModelConfig
from jaxllm.parallel.mesh import MESH_AXES, logical_to_spec
from pallas_kernels.activation import kernel_cpu as activation_cpu
from pallas_kernels.matmul import kernel_cpu as matmul_cpu
from pallas_kernels.ragged_paged_attention import kernel_cpu as attention_cpu

KERNEL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
CPU_ONLY = (matmul_cpu.TARGET, matmul_cpu.ARGMAX_TARGET, activation_cpu.TARGET,
            attention_cpu.TARGET, "cpu_callback")
# Triton calls carry no serialization-compatibility guarantee; the check would refuse them.
UNCHECKED = [export.DisabledSafetyCheck.custom_call(KERNEL["cuda"])]
S, T, NUM_BLOCKS, BLOCK, TABLE = 8, 16, 32, 16, 8  # sequences, tokens, cache blocks


def export_config() -> ModelConfig:
    from transformers import LlamaConfig
    hf = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf.architectures = ["LlamaForCausalLM"]
    return ModelConfig.from_hf(hf, EngineArgs(model="tiny", dtype="bfloat16")
                               .create_engine_config().model)


def exported_step(platform: str, tp: int, cfg: ModelConfig = None,
                  cache_dtype=None) -> export.Exported:
    """cache_dtype: the KV caches' (default the model's dtype)."""
    cfg = cfg or export_config()
    mesh = AbstractMesh((1, tp, 1), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    model = abstract_decoder(cfg, PallasBackend(mesh if tp > 1 else None))
    graphdef, state = nnx.split(model)

    def step(state, kv_caches, token_ids, positions, md, logits_indices, num_rows, tensors,
             lora_slots=None):
        m = nnx.merge(graphdef, state)
        hidden, kv_caches = m(kv_caches, token_ids, positions, md, lora_slots)
        out = sample_rows(hidden[logits_indices], num_rows, m.compute_logits, tensors,
                          greedy_head=m.greedy_head)
        return out, kv_caches

    def spec(axes, shape):
        return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))

    def arg(x, axes=None):
        shape = np.shape(x)
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        return jax.ShapeDtypeStruct(shape, dtype, sharding=spec(axes or (None,) * len(shape),
                                                                shape))

    params = jax.tree.map(lambda v: arg(v, v.get_metadata()["out_sharding"]), state,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    caches = tuple(KVCache(*[arg(jax.ShapeDtypeStruct(s, cache_dtype or cfg.jnp_dtype),
                                 KV_CACHE_AXES)] * 2)
                   for s in model.kv_cache_shapes(NUM_BLOCKS, BLOCK))
    i32 = lambda *shape: arg(jax.ShapeDtypeStruct(shape, jnp.int32))  # noqa: E731
    md = AttentionMetadata(i32(T), i32(S), i32(S, TABLE), i32(S + 1), i32(1))
    # The sampler variant with the most work: random rows, top-k/top-p, penalties, logprobs.
    _, tensors = warmup_tensors(S, cfg.vocab_size, max_logprobs=4, penalty_width=300)[-1]
    args = (params, caches, i32(T), i32(T), md, i32(S), i32(), jax.tree.map(arg, tensors),
            *((i32(T),) if cfg.lora is not None else ()))  # each token's LoRA slot
    return export.export(jax.jit(step, donate_argnums=1), platforms=(platform,),
                         disabled_checks=UNCHECKED)(*args)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_step_exports_with_the_platforms_kernel_and_nothing_cpu_only(platform, tp):
    exported = exported_step(platform, tp)
    text = exported.mlir_module()
    assert exported.platforms == (platform,) and exported.nr_devices == tp
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {KERNEL[platform]}
    assert not [name for name in CPU_ONLY if name in text]
    if tp > 1:  # the weights and caches arrive sharded; the kernel runs per shard of KV heads
        assert '{"model"}' in text and "sdy.manual_computation" in text
    assert len(exported.mlir_module_serialized) > 0  # the portable StableHLO bytecode
