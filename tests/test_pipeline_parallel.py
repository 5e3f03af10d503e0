"""Pipeline parallelism: the layer split (vLLM's, and its override), the refusals, the stage
timeline's arithmetic, and (slow, 8 virtual CPU devices in a subprocess: this file's __main__)
PP 2, PP 4 and PP 2 x TP 2 engines giving the single-device engine's tokens on mixed prompts
with chunked prefill and preemption, each stage holding only its layers, and two stages busy
at once while steps are in flight.
"""

import json
import os
import sys

import pytest

from conftest import run_with_host_devices
from jaxllm.config import ConfigError, EngineArgs
from jaxllm.parallel.pipeline import stage_layer_ranges, stage_meshes
from jaxllm.worker.pipeline_timeline import StageTimeline


@pytest.fixture
def no_partition_env(monkeypatch):
    for name in ("JAXLLM_PP_LAYER_PARTITION", "VLLM_PP_LAYER_PARTITION"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_default_split_is_vllms(no_partition_env):
    # vLLM's get_pp_indices: equal shares, the remainder one layer each to the stages
    # before the last.
    assert stage_layer_ranges(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert stage_layer_ranges(4, 2) == [(0, 2), (2, 4)]
    assert stage_layer_ranges(3, 2) == [(0, 2), (2, 3)]
    with pytest.raises(ConfigError, match="only 2 layers"):
        stage_layer_ranges(2, 4)


def test_partition_override_and_its_refusals(no_partition_env):
    no_partition_env.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    assert stage_layer_ranges(4, 2) == [(0, 1), (1, 4)]
    no_partition_env.setenv("JAXLLM_PP_LAYER_PARTITION", "3,1")  # ours first
    assert stage_layer_ranges(4, 2) == [(0, 3), (3, 4)]
    for bad, match in (("2,2,0", "gives 3 stages"), ("1,2", "sum to the model's 4"),
                       ("4,0", "must be positive"), ("a,b", "comma-separated")):
        no_partition_env.setenv("JAXLLM_PP_LAYER_PARTITION", bad)
        with pytest.raises(ConfigError, match="JAXLLM_PP_LAYER_PARTITION") as e:
            stage_layer_ranges(4, 2)
        assert match in str(e.value)


def test_too_few_devices_refused_with_the_numbers():
    import jax

    n = len(jax.devices())
    with pytest.raises(ConfigError, match=rf"--pipeline-parallel-size=2: 2 stages x "
                                          rf"--tensor-parallel-size {n} need {2 * n} devices, "
                                          rf"but {n} CPU device"):
        stage_meshes(2, n)


@pytest.mark.parametrize("flags, name", [
    (dict(data_parallel_size=2), "--data-parallel-size"),
    (dict(enable_expert_parallel=True), "--enable-expert-parallel"),
    (dict(num_scheduler_steps=4), "--num-scheduler-steps"),
    (dict(runner="pooling"), "--runner"),
])
def test_unsupported_combinations_refused_by_name(flags, name):
    with pytest.raises(ConfigError, match=f"--pipeline-parallel-size=2 with {name}"):
        EngineArgs(pipeline_parallel_size=2, **flags)


def test_stages_across_hosts_accepted():
    """--nnodes with a pipeline is no longer refused (tests/test_multihost.py runs it)."""
    assert EngineArgs(pipeline_parallel_size=2, nnodes=2).nnodes == 2


class _Device:
    platform = "cpu"

    def __init__(self, process_index: int):
        self.process_index = process_index


def test_stages_not_aligned_to_hosts_refused(monkeypatch):
    """Across hosts every device is a stage's and no stage spans two hosts."""
    import jax

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "local_device_count", lambda: 4)
    devices = [_Device(0)] * 4 + [_Device(1)] * 4
    with pytest.raises(ConfigError, match=r"--pipeline-parallel-size=2 --tensor-parallel-size"
                                          r"=3: stage 0 would span hosts \[0, 1\]"):
        stage_meshes(2, 3, devices[2:])  # hosts with 2 and 4 devices: stage 0 on both
    with pytest.raises(ConfigError, match=r"--pipeline-parallel-size=2 x --tensor-parallel-"
                                          r"size=2 = 4: on 2 hosts the stages must use all 8"):
        stage_meshes(2, 2, devices)


def test_timeline_overlap_arithmetic():
    """Two stages, three steps: stage 1 of step k runs while stage 0 runs step k+1."""
    tl = StageTimeline(2)
    tl.close()
    # (dispatch, end) per step; starts follow from the previous end on the stage and the
    # end of the stage before.
    for stage, steps in enumerate([[(0.0, 1.0), (0.0, 2.0), (0.0, 3.0)],
                                   [(0.0, 2.0), (0.0, 3.0), (0.0, 4.0)]]):
        for dispatch, end in steps:
            tl.record(stage, dispatch, end)
    assert tl.intervals() == [[(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)],
                              [(1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]]
    s = tl.summary()
    assert s["steps"] == 3 and s["busy"] == [0.75, 0.75]
    assert s["overlap_fraction"] == pytest.approx(2 / 4)


def test_stage_steps_export_for_tpu():
    """Each stage's program (`stage_forward`, what the pipeline runner jits per stage) exports
    for TPU from this host, with the Pallas kernel and nothing CPU-only (as test_export.py
    checks the whole step): the first stage from token ids, the last to the sampler's rows."""
    import re

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax import export
    from jax.sharding import AbstractMesh, AxisType, NamedSharding

    from jaxllm.layers.attention import KV_CACHE_AXES, AttentionMetadata, KVCache
    from jaxllm.layers.backends.pallas import PallasBackend
    from jaxllm.models.decoder import abstract_decoder
    from jaxllm.models.pipeline_stage import stage_config, stage_forward
    from jaxllm.parallel.mesh import MESH_AXES, logical_to_spec
    from test_export import BLOCK, CPU_ONLY, KERNEL, NUM_BLOCKS, TABLE, S, T, export_config

    cfg, tp = export_config(), 2  # a tensor-parallel stage: its weights and caches arrive sharded
    mesh = AbstractMesh((1, tp, 1), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))

    def arg(shape, dtype, axes=None):
        spec = logical_to_spec(axes or (None,) * len(shape), shape, mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    i32 = lambda *shape: arg(shape, jnp.int32)  # noqa: E731
    md = AttentionMetadata(i32(T), i32(S), i32(S, TABLE), i32(S + 1), i32(1))
    for (start, end), x in (((0, 1), i32(T)), ((1, 2), arg((T, cfg.hidden_size), cfg.jnp_dtype))):
        stage = abstract_decoder(stage_config(cfg, start, end), PallasBackend(mesh),
                                 first=start == 0, last=end == cfg.num_layers)
        graphdef, state = nnx.split(stage)
        params = jax.tree.map(lambda v: arg(v.shape, v.dtype, v.get_metadata()["out_sharding"]),
                              state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        caches = tuple(KVCache(*[arg(s, cfg.jnp_dtype, KV_CACHE_AXES)] * 2)
                       for s in stage.kv_cache_shapes(NUM_BLOCKS, BLOCK))

        def step(state, kv, x, positions, md, logits_indices):
            return stage_forward(nnx.merge(graphdef, state), kv, x, positions, md,
                                 logits_indices)

        exported = export.export(jax.jit(step, donate_argnums=1), platforms=("tpu",))(
            params, caches, x, i32(T), md, i32(S))
        text = exported.mlir_module()
        assert exported.nr_devices == tp
        assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {KERNEL["tpu"]}
        assert not [name for name in CPU_ONLY if name in text]
        shapes = [o.shape for o in exported.out_avals]
        if end < cfg.num_layers:  # hidden states for the next stage, then the caches
            assert shapes[0] == (T, cfg.hidden_size) and len(shapes) == 1 + 2 * len(caches)
        else:  # the sampler's rows, all hidden states, the caches
            assert shapes[:2] == [(S, cfg.hidden_size), (T, cfg.hidden_size)]
        assert ("embed" in nnx.to_pure_dict(state)) == (start == 0 or cfg.tie_word_embeddings)
        assert ("final_norm" in nnx.to_pure_dict(state)) == (end == cfg.num_layers)


@pytest.mark.slow
def test_pipeline_engines_match_single_device(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama", num_hidden_layers=4)
    # The timeline's model: large enough that a stage's program outlasts the host's work
    # between dispatches (see _timeline_child).
    wide = make_tiny_checkpoint("llama", num_hidden_layers=4, hidden_size=512,
                                intermediate_size=2048, num_attention_heads=8,
                                num_key_value_heads=4, max_position_embeddings=512)
    proc = run_with_host_devices(8, [__file__, path, wide], timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    base, timeline = report.pop("base"), report.pop("timeline")
    assert base["preemptions"] > 0  # the small cache makes the comparison cover preemption
    for name, run in report.items():
        assert run["tokens"] == base["tokens"], name
        pp, tp = run["pp"], run["tp"]
        mem = run["memory"]
        assert [m["layers"] for m in mem] == [4 // pp] * pp, name
        assert [len(m["devices"]) for m in mem] == [tp] * pp
        assert len({d for m in mem for d in m["devices"]}) == pp * tp  # stages share no device
        # A stage holds its layers only: less than the whole model's weights on a device.
        assert all(m["weight_bytes_per_device"] < base["weight_bytes"] for m in mem), name
        assert run["preemptions"] > 0, name
    # Middle stages hold no embedding and no LM head: less than the first and last stage.
    middle = report["pp4"]["memory"][1:3]
    assert all(m["weight_bytes_per_device"] < report["pp4"]["memory"][0]["weight_bytes_per_device"]
               for m in middle)
    # While steps are in flight the stages work at once. Lockstep (one step in flight) gave
    # 0.0 on this model in probes, steps in flight ~0.5.
    assert timeline["steps"] > 10
    assert timeline["overlap_fraction"] > 0.2, timeline


@pytest.mark.slow
def test_moe_stages_split_layer_groups(make_tiny_checkpoint):
    """Qwen2-MoE with a dense layer between MoE ones (three layer groups): stage 0 gets layers
    0-1 (a MoE and the dense group), stage 1 layer 2; eager steps, same tokens as one device."""
    path = make_tiny_checkpoint("qwen2_moe")
    proc = run_with_host_devices(2, [__file__, path, "moe"], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["layers"] == [2, 1]
    assert report["pp2"] == report["base"] and len(report["base"]) == 3


def _moe_child(path: str) -> dict:
    from jaxllm import SamplingParams
    from jaxllm.config import EngineArgs
    from jaxllm.engine.engine import LLMEngine

    report = {}
    for name, pp in (("base", 1), ("pp2", 2)):
        engine = LLMEngine(EngineArgs(model=path, dtype="float32", enforce_eager=True,
                                max_model_len=64, num_gpu_blocks_override=8,
                                attention_backend="reference", use_tqdm_on_load=False,
                                max_num_batched_tokens=8, pipeline_parallel_size=pp))
        for i, p in enumerate([list(range(5, 15)), [30, 31], [40, 41, 42, 43, 44]]):
            engine.add_request(str(i), {"prompt_token_ids": p},
                               SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        out = {}
        while engine.has_unfinished_requests():
            out.update((o.request_id, o.outputs[0].token_ids) for o in engine.step()
                       if o.finished)
        report[name] = out
        if pp > 1:
            report["layers"] = [m["layers"] for m in engine.runner.memory_report()]
    return report


def _child(path: str) -> dict:
    import time

    import jax
    import numpy as np

    from jaxllm import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 500, n)]}
               for n in (5, 40, 17, 70, 3, 52, 11, 33)]
    params = [SamplingParams(max_tokens=10 + i, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    # Chunked prefill (16-token steps), and 8 blocks of 16 tokens for up to 4 sequences of
    # up to 87 tokens: preemption.
    common = dict(dtype="float32", max_num_batched_tokens=16, max_num_seqs=4,
                  num_gpu_blocks_override=8, max_model_len=128, block_size=16,
                  attention_backend="reference", disable_log_stats=True)
    report = {}
    for name, pp, tp in (("base", 1, 1), ("pp2", 2, 1), ("pp4", 4, 1), ("pp2tp2", 2, 2)):
        t = time.perf_counter()
        llm = LLM(path, pipeline_parallel_size=pp, tensor_parallel_size=tp, **common)
        print(f"{name}: started in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        engine = llm.llm_engine
        outs = llm.generate(prompts, params, use_tqdm=False)
        run = {"pp": pp, "tp": tp, "tokens": [o.outputs[0].token_ids for o in outs],
               "preemptions": engine.stats().num_preemptions}
        if pp > 1:
            run["memory"] = engine.runner.memory_report()
        else:
            state = engine.runner.state
            run["weight_bytes"] = sum(x.addressable_shards[0].data.nbytes
                                      for x in jax.tree.leaves(state))
        report[name] = run
        del llm, engine
    return report


def _timeline_child(path: str) -> dict:
    """PP 2's stage timeline on 8 prompts of 200 tokens in 256-token chunks. The stages must
    be the bottleneck for steps in flight to overlap: with the tiny model of `_child` each
    program took ~1 ms against several of host work per step, so the overlap measured there
    was near the timeline's own noise (0.0-0.07 in lockstep, 0.03-0.24 in flight)."""
    import numpy as np

    from jaxllm import LLM, SamplingParams

    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 500, 200)]}
               for _ in range(8)]
    llm = LLM(path, pipeline_parallel_size=2, dtype="float32", max_num_batched_tokens=256,
              max_num_seqs=8, max_model_len=512, disable_log_stats=True)
    llm.llm_engine.runner.start_timeline()
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    return llm.llm_engine.runner.stop_timeline()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if sys.argv[2:] == ["moe"]:
        print(json.dumps(_moe_child(sys.argv[1])))
    else:
        print(json.dumps({**_child(sys.argv[1]), "timeline": _timeline_child(sys.argv[2])}))
