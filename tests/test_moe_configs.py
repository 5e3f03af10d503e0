"""The MoE deployment configs validate against their real models' shapes, and an MoE step
exports for TPU with the Pallas backend (as tests/test_export.py does for dense models).

The models' configs are written out here from their published config.json (no download): the
check is that start-up's model config, layer groups and expert sharding accept the file's
parallel layout on an abstract mesh of its size.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from jax.sharding import AbstractMesh, AxisType

from serving.cli.serve import parse_args
from jaxllm.config import EngineArgs
from jaxllm.models.model_config import ModelConfig
from jaxllm.parallel.mesh import MESH_AXES, logical_to_spec

CONFIG_DIR = Path(__file__).parent.parent / "configs"


def _hf(name: str):
    import transformers as tr

    if name == "mixtral":  # mistralai/Mixtral-8x7B-Instruct-v0.1
        c = tr.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                             num_local_experts=8, num_experts_per_tok=2,
                             max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5)
        c.architectures = ["MixtralForCausalLM"]
    else:  # Qwen/Qwen3-30B-A3B
        c = tr.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                              moe_intermediate_size=768, num_hidden_layers=48,
                              num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                              num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                              max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6)
        c.architectures = ["Qwen3MoeForCausalLM"]
    return c


@pytest.mark.parametrize("config,model", [("mixtral-8x7b-ep.yaml", "mixtral"),
                                          ("tpu-v6e-8-qwen3-30b-a3b-ep.yaml", "qwen3_moe")])
def test_moe_config_validates(config, model):
    from jaxllm.models.decoder import abstract_decoder, layer_groups

    args = EngineArgs.from_cli_args(parse_args(["--config", str(CONFIG_DIR / config)]))
    tp = args.tensor_parallel_size
    assert args.enable_expert_parallel and tp == 8
    cfg = ModelConfig.from_hf(_hf(model), args.create_engine_config().model)
    assert cfg.expert_parallel and cfg.num_experts % tp == 0
    assert [g.kind for g in layer_groups(cfg)] == ["moe"]
    assert cfg.max_model_len == args.max_model_len
    mesh = AbstractMesh((1, tp, 1), MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    experts = abstract_decoder(cfg).layers[0].experts_gate_up
    spec = logical_to_spec(experts.get_metadata()["out_sharding"], experts.shape, mesh)
    assert tuple(spec) == (None, "model", None, None, None)  # whole experts per device


def _moe_config(expert_parallel: bool) -> ModelConfig:
    from transformers import Qwen3MoeConfig

    hf = Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                        moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=256)
    hf.architectures = ["Qwen3MoeForCausalLM"]
    args = EngineArgs(model="tiny", dtype="bfloat16", enable_expert_parallel=expert_parallel)
    return ModelConfig.from_hf(hf, args.create_engine_config().model)


@pytest.mark.parametrize("tp,ep", [(1, False), (2, True), (2, False)],
                         ids=["1-device", "ep2", "tp2"])
def test_moe_step_exports_for_tpu_with_megablox(tp, ep):
    from test_export import CPU_ONLY, KERNEL, exported_step

    exported = exported_step("tpu", tp, _moe_config(ep))
    text = exported.mlir_module()
    assert exported.platforms == ("tpu",) and exported.nr_devices == tp
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    assert set(calls) == {KERNEL["tpu"]}
    # attention and the two grouped matmuls (gate/up, down) of each MoE layer's scan body
    assert len(calls) >= 3
    assert "ragged_dot" not in text  # the grouped matmul is megablox's kernel on TPU
    assert not [name for name in CPU_ONLY if name in text]
    if tp > 1:  # the experts run per shard (shard_map) with a psum
        assert "sdy.manual_computation" in text and "all_reduce" in text
