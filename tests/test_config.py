"""EngineArgs: vLLM's names and defaults, sizes like 1k/1K, bad values named, CLI generated."""

import argparse

import pytest

from jaxllm.config import ConfigError, EngineArgs, parse_size


def test_parse_size_like_vllm():
    assert parse_size("1k") == 1000 and parse_size("1K") == 1024
    assert parse_size("2048") == 2048 and parse_size(4096) == 4096
    assert EngineArgs(max_model_len="4k").max_model_len == 4000
    with pytest.raises(ConfigError, match="--max-model-len"):
        EngineArgs(max_model_len="lots")


def test_vllm_defaults():
    a = EngineArgs()
    assert (a.tensor_parallel_size, a.block_size, a.max_num_seqs, a.gpu_memory_utilization,
            a.dtype, a.load_format, a.max_logprobs) == (1, 16, 256, 0.9, "auto", "auto", 20)
    c = a.create_engine_config()
    assert c.cache.enable_prefix_caching and c.scheduler.enable_chunked_prefill
    assert a.scheduling_policy == "fcfs"


@pytest.mark.parametrize("kwargs,flag", [
    (dict(dtype="float64"), "--dtype"),
    (dict(load_format="onnx"), "--load-format"),
    (dict(tensor_parallel_size=0), "--tensor-parallel-size"),
    (dict(pipeline_parallel_size=0), "--pipeline-parallel-size"),
    (dict(pipeline_parallel_size=2, enable_expert_parallel=True), "--pipeline-parallel-size"),
    (dict(block_size=24), "--block-size"),
    (dict(quantization="bitsandbytes"), "--quantization"),
    (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization"),
    (dict(hf_overrides="{not json"), "--hf-overrides"),
    (dict(trust_remote_code=True), "--trust-remote-code"),
])
def test_bad_values_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineArgs(**kwargs)


def test_unknown_engine_argument():
    with pytest.raises(ConfigError, match="tensor_paralel_size"):
        EngineArgs.from_kwargs(tensor_paralel_size=2)


def test_cli_is_generated_from_the_fields():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(), positional_model=True)
    args = parser.parse_args(["some/model", "--tensor-parallel-size", "4", "--no-enable-prefix-caching",
                              "--max-model-len", "2K", "--served-model-name", "a", "b",
                              "--rope-scaling", '{"rope_type": "linear", "factor": 2.0}'])
    e = EngineArgs.from_cli_args(args)
    assert e.model == "some/model" and e.tensor_parallel_size == 4
    assert e.enable_prefix_caching is False and e.max_model_len == 2048
    assert e.served_model_name == ["a", "b"] and e.rope_scaling["factor"] == 2.0
    unset = EngineArgs.from_cli_args(parser.parse_args([]))
    assert unset == EngineArgs()  # flags not given keep the dataclass defaults
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float64"])  # choices enforced by argparse too


def test_vllms_short_flags():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(), positional_model=True)
    args = parser.parse_args(["m", "-tp", "2", "-pp", "1", "-dp", "1"])
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (
        2, 1, 1)
    with pytest.raises(ConfigError, match="--quantization"):
        EngineArgs.from_cli_args(parser.parse_args(["m", "-q", "bitsandbytes"]))


@pytest.mark.parametrize("argv, match", [
    (["a/model", "--model", "b/model"], "disagree"),
    (["--enable-chunked-prefill", "False"], "boolean"),
    (["--enforce-eager", "true"], "boolean"),
])
def test_positional_model_mistakes_are_refused(argv, match):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(), positional_model=True)
    with pytest.raises(ConfigError, match=match):
        EngineArgs.from_cli_args(parser.parse_args(argv))
    same = parser.parse_args(["a/model", "--model", "a/model"])
    assert EngineArgs.from_cli_args(same).model == "a/model"


def test_expert_parallel_is_refused_for_a_model_without_experts(tiny_llama):
    """--enable-expert-parallel is not accepted and ignored: a dense model has nothing to shard."""
    from jaxllm.loader.loader import load_model
    from jaxllm.parallel.mesh import make_mesh

    config = EngineArgs(model=tiny_llama, enable_expert_parallel=True).create_engine_config()
    with pytest.raises(ConfigError, match="--enable-expert-parallel: LlamaForCausalLM"):
        load_model(config.load, config.model, make_mesh())


def test_engine_config_resolves_the_defaults_and_is_frozen():
    """create_engine_config: the flags' defaults that depend on others resolved, the user's
    own values (None: decided at start-up) kept, renamed flags mapped, every part frozen."""
    import dataclasses

    from jaxllm.engine_config import ModelOptions

    c = EngineArgs().create_engine_config()
    assert c.cache.enable_prefix_caching is True and c.scheduler.enable_chunked_prefill is True
    assert c.scheduler.enforce_eager is False and c.parallel.data_parallel_size_local == 1
    assert c.model.max_model_len is None and c.scheduler.max_num_batched_tokens is None
    assert c.model == ModelOptions()  # the neutral options are EngineArgs' defaults
    off = EngineArgs(enable_prefix_caching=False, enable_chunked_prefill=False,
                     optimization_level=0, data_parallel_size=4, data_parallel_size_local=2,
                     kv_cache_dtype="fp8", scheduling_policy="priority").create_engine_config()
    assert (off.cache.enable_prefix_caching, off.scheduler.enable_chunked_prefill) == (False, False)
    assert off.scheduler.enforce_eager is True  # -O0
    assert (off.parallel.data_parallel_size, off.parallel.data_parallel_size_local) == (4, 2)
    assert EngineArgs(data_parallel_size=4).create_engine_config().parallel \
        .data_parallel_size_local == 4  # default: every replica on this node
    assert (off.cache.cache_dtype, off.scheduler.policy) == ("fp8", "priority")
    for part in (c, c.load, c.model, c.cache, c.scheduler, c.parallel):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, dataclasses.fields(part)[0].name, None)
