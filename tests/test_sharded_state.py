"""`jaxllm convert` and `--load-format sharded_state` (issue 52): the loaded weights saved with
orbax-checkpoint and restored onto meshes of other sizes.

The tiny float32 model is converted on a 2-device mesh (tensor parallel, in a process with
virtual CPU devices), then restored on 1 device here and on 4 in another process: greedy tokens
equal the original checkpoint's. A weight-quantized (fp8) conversion restores its float8
weights as they were quantized at load. Mismatched flags are refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError
from conftest import run_with_host_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 9]}, {"prompt_token_ids": [3, 8, 100, 21, 7, 64]}]
SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SMALL = dict(max_model_len=64, kv_cache_memory_bytes=2 << 20, max_num_seqs=4)


def _tokens(model: str, **engine) -> list[list[int]]:
    llm = LLM(model, **SMALL, **engine)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP, use_tqdm=False)]


def _convert(model: str, out: str, *flags: str, devices: int = 1) -> None:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "serving.cli.main", "convert", model, out,
                           *flags], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def converted(tiny_llama, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("sharded") / "tp2")
    _convert(tiny_llama, out, "--dtype", "float32", "--tensor-parallel-size", "2", devices=2)
    return out


@pytest.mark.slow  # ~40 s: a 4-device process
def test_restores_on_other_mesh_sizes(tiny_llama, converted):
    assert set(os.listdir(converted)) >= {"config.json", "jaxllm_sharded_state.json", "state",
                                          "tokenizer.json", "generation_config.json"}
    want = _tokens(tiny_llama, dtype="float32")
    assert _tokens(converted) == want  # 1 device, format detected
    code = (f"import json; from jaxllm import LLM, SamplingParams as S; llm = LLM("
            f"{converted!r}, load_format='sharded_state', tensor_parallel_size=4, "
            f"**{SMALL!r}); print(json.dumps([o.outputs[0].token_ids for o in llm.generate("
            f"{PROMPTS!r}, S(temperature=0.0, max_tokens=8, ignore_eos=True), "
            f"use_tqdm=False)]))")
    proc = run_with_host_devices(4, ["-c", code], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == want


def test_quantized_conversion(tiny_llama, tmp_path):
    out = str(tmp_path / "fp8")
    _convert(tiny_llama, out, "--quantization", "fp8")
    llm = LLM(out, **SMALL)
    assert llm.llm_engine.weight_bytes.get("float8_e4m3fn", 0) > 0
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP, use_tqdm=False)]
    assert got == _tokens(tiny_llama, quantization="fp8")
    with pytest.raises(ConfigError, match="--dtype=float32: .* holds bfloat16 weights"):
        LLM(out, dtype="float32", **SMALL)


def test_refusals(tiny_llama, converted, tmp_path):
    with pytest.raises(ConfigError, match="--quantization=fp8: .* converted with "
                                          "--quantization=None"):
        LLM(converted, quantization="fp8", **SMALL)
    with pytest.raises(ConfigError, match="is not a sharded_state folder"):
        LLM(tiny_llama, load_format="sharded_state", **SMALL)
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "serving.cli.main", "convert", tiny_llama,
                           converted], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0 and "already holds a sharded_state checkpoint" in proc.stderr
