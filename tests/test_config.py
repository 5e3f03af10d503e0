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
    assert a.prefix_caching and a.chunked_prefill and a.scheduling_policy == "fcfs"


@pytest.mark.parametrize("kwargs,flag", [
    (dict(dtype="float64"), "--dtype"),
    (dict(load_format="onnx"), "--load-format"),
    (dict(tensor_parallel_size=0), "--tensor-parallel-size"),
    (dict(pipeline_parallel_size=0), "--pipeline-parallel-size"),
    (dict(pipeline_parallel_size=2, enable_expert_parallel=True), "--pipeline-parallel-size"),
    (dict(block_size=24), "--block-size"),
    (dict(quantization="awq"), "--quantization"),
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
        EngineArgs.from_cli_args(parser.parse_args(["m", "-q", "awq"]))


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

    args = EngineArgs(model=tiny_llama, enable_expert_parallel=True)
    with pytest.raises(ConfigError, match="--enable-expert-parallel: LlamaForCausalLM"):
        load_model(args, make_mesh())
