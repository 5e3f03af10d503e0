"""Multi-LoRA serving through `LLM`: peft adapters of several ranks and targets, and the base
model, in one batch with fewer device slots than adapters — each prompt's greedy tokens and
their logprobs equal transformers + peft on its own adapter (float32). Adapters are made here
with peft, their B matrices random (init_lora_weights=False), so each changes the output."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxllm import LLM, LoRARequest, SamplingParams
from jaxllm.config import ConfigError
from lora_adapters import ADAPTERS, make_adapters, oracle, requests

NEW = 6


@pytest.fixture(autouse=True)
def _fail_on_recompile(monkeypatch):
    monkeypatch.setenv("JAXLLM_FAIL_ON_RECOMPILE", "1")


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    return make_adapters(tiny_llama, str(tmp_path_factory.mktemp("lora")))


def lora_llm(path: str, **kw) -> LLM:
    args = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                use_tqdm_on_load=False, seed=0, disable_log_stats=True, enable_lora=True,
                max_loras=2, max_lora_rank=16)
    return LLM(path, **{**args, **kw})


def test_mixed_batch_equals_peft(tiny_llama, adapters):
    """Base and three adapters (two slots), two prompts each, in one generate call: slots are
    refilled mid-run, and every output matches its own adapter's oracle."""
    llm = lora_llm(tiny_llama)
    reqs = requests(adapters)
    rng = np.random.default_rng(0)
    names = [None, "all", "qv", "oud"] * 2
    prompts = [rng.integers(3, 500, size=int(rng.integers(4, 20))).tolist() for _ in names]
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                        lora_request=[reqs.get(n) for n in names], use_tqdm=False)
    assert llm.llm_engine.lora_slots.num_writes > 2  # three adapters through two slots
    base_tokens = {}
    for name, p, out in zip(names, prompts, outs):
        assert out.lora_request == reqs.get(name)
        want, want_lps = oracle(adapters[name][1], p, NEW)
        got = out.outputs[0]
        assert list(got.token_ids) == want, name
        got_lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(got_lps, want_lps, atol=2e-4, err_msg=str(name))
        if name is None:
            base_tokens[tuple(p)] = want
    # the adapters matter: on the base model's prompts, each changes the continuation
    p = prompts[0]
    assert any(oracle(adapters[n][1], p, NEW)[0] != base_tokens[tuple(p)] for n in ADAPTERS)


def test_waits_for_a_slot_and_keeps_kv_apart(tiny_llama, adapters):
    """Two slots, three adapters at once: the third adapter's request waits for a slot (it
    does not fail). The same prompt under two adapters and the base model never shares
    prefix-cache blocks: each result equals its own oracle, run after the others cached it."""
    # The other tests' configuration (its programs are compiled once for the module).
    llm = lora_llm(tiny_llama, enable_prefix_caching=True)
    reqs = requests(adapters)
    prompt = list(range(5, 5 + 17))  # four full blocks of 4
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for name in ["all", "qv", None, "all"]:  # "all" last: a hit on its own blocks is fine
        out = llm.generate({"prompt_token_ids": prompt}, sp, lora_request=reqs.get(name),
                           use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == oracle(adapters[name][1], prompt, NEW)[0], name
    names = ["qv", "oud", "all"]
    three = llm.generate([{"prompt_token_ids": prompt}] * 3, sp,
                         lora_request=[reqs[n] for n in names], use_tqdm=False)
    for name, out in zip(names, three):
        assert list(out.outputs[0].token_ids) == oracle(adapters[name][1], prompt, NEW)[0]


@pytest.mark.slow  # an engine per refusal (~30 s in all)
def test_refusals_name_the_problem(tiny_llama, adapters, tmp_path):
    with pytest.raises(ConfigError, match="--max-loras.*needs --enable-lora"):
        LLM(tiny_llama, max_loras=2)
    with pytest.raises(ConfigError, match="--runner.*--enable-lora"):
        LLM(tiny_llama, enable_lora=True, runner="pooling")
    with pytest.raises(ConfigError, match="--batch-invariant.*LoRA"):
        lora_llm(tiny_llama, batch_invariant=True, dtype="bfloat16")
    llm = lora_llm(tiny_llama, max_lora_rank=8)
    sp = SamplingParams(max_tokens=2)
    # rank 16 > --max-lora-rank 8
    with pytest.raises(ValueError, match="rank 16 .*--max-lora-rank 8"):
        llm.generate("hi", sp, lora_request=LoRARequest("oud", 3, adapters["oud"][0]))
    # DoRA and a non-LoRA module are refused by name
    path = adapters["qv"][0]
    for key, value, match in (("use_dora", True, "DoRA"), ("bias", "all", "bias")):
        bad = tmp_path / key
        bad.mkdir()
        conf = json.load(open(os.path.join(path, "adapter_config.json")))
        conf[key] = value
        json.dump(conf, open(bad / "adapter_config.json", "w"))
        os.link(os.path.join(path, "adapter_model.safetensors"),
                bad / "adapter_model.safetensors")
        with pytest.raises(ValueError, match=match):
            llm.generate("hi", sp, lora_request=LoRARequest(key, 9, str(bad)))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate("hi", sp, lora_request=LoRARequest("none", 10, str(tmp_path)))
    # the engine still serves after the refusals
    assert llm.generate("hi", sp, use_tqdm=False)[0].outputs[0].token_ids
    plain = LLM(tiny_llama, dtype="float32", use_tqdm_on_load=False, max_num_seqs=4,
                max_num_batched_tokens=64, disable_log_stats=True)
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.generate("hi", sp, lora_request=LoRARequest("qv", 2, path))


@pytest.mark.parametrize("extra", [
    pytest.param(dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
                 id="ngram", marks=pytest.mark.slow),  # an engine with a drafter (~15 s)
    pytest.param(dict(num_scheduler_steps=4), id="multi-step")])
def test_with_speculation_and_multi_step(tiny_llama, adapters, extra):
    """Drafts are verified, and multi-step bursts run, with each token's adapter."""
    llm = lora_llm(tiny_llama, **extra)
    reqs = requests(adapters)
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9]  # repeats, so n-gram drafts are proposed
    names = [None, "all", "qv"]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, sp,
                        lora_request=[reqs.get(n) for n in names], use_tqdm=False)
    for name, out in zip(names, outs):
        assert list(out.outputs[0].token_ids) == oracle(adapters[name][1], prompt, 10)[0], name


def test_structured_output_with_an_adapter(tiny_llama, adapters):
    """A grammar constrains an adapter's tokens as it does the base model's."""
    from jaxllm import StructuredOutputsParams

    llm = lora_llm(tiny_llama)
    sp = SamplingParams(max_tokens=12, temperature=0.0,
                        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    outs = llm.generate(["pick:"] * 2, sp, lora_request=[None, requests(adapters)["all"]],
                        use_tqdm=False)
    assert all(o.outputs[0].text in ("alpha", "beta") for o in outs), [o.outputs[0].text
                                                                     for o in outs]
    chat = llm.chat([{"role": "user", "content": "pick"}], sp,
                    lora_request=requests(adapters)["qv"], use_tqdm=False)[0]
    assert chat.outputs[0].text in ("alpha", "beta") and chat.lora_request.lora_name == "qv"


@pytest.mark.slow  # two engines in bfloat16 (~25 s); the float32 tests cover the path
def test_bfloat16_on_the_default_backend(tiny_llama, adapters):
    """bf16 weights and adapters (the CPU backend keeps them as bits: the slots are written
    so): the adapter's teacher-forced logprobs are near its float32 oracle's, far from the
    base model's."""
    import torch

    llm = lora_llm(tiny_llama, dtype="bfloat16")
    prompt = list(range(20, 36))
    tokens, _ = oracle(adapters["all"][1], prompt, 8)
    seq = prompt + tokens
    with torch.no_grad():
        def teacher(model):
            lp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].double(), -1)
            return np.array([float(lp[i, seq[i + 1]]) for i in range(len(seq) - 1)])
        want, base = teacher(adapters["all"][1]), teacher(adapters[None][1])
    out = llm.generate({"prompt_token_ids": seq}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       lora_request=requests(adapters)["all"], use_tqdm=False)[0]
    got = np.array([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], seq[1:])])
    err, gap = np.abs(got - want).max(), np.abs(base - want).max()
    assert err < 0.1 and err < gap / 5, (err, gap)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # TP 2: ~15-40 s
def test_lora_step_exports_for_the_accelerators(platform, tp):
    """The step with adapter slots lowers for TPU and GPU with only the platform's attention
    kernel as a custom call (the LoRA delta is plain XLA: dots, gathers, a conditional), its
    slots sharded with their projections on a 2-device mesh."""
    import dataclasses
    import re

    from jaxllm.engine_config import LoRAConfig
    from test_export import KERNEL, exported_step, export_config

    cfg = dataclasses.replace(export_config(), lora=LoRAConfig(4, 8, 4, "auto"))
    text = exported_step(platform, tp, cfg).mlir_module()
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {KERNEL[platform]}
    assert "stablehlo.case" in text or "stablehlo.if" in text  # no adapter: nothing computed
    if tp > 1:
        assert '{"model"}' in text


def test_adapters_over_a_quantized_base(tiny_llama, adapters, tmp_path):
    """A W8A16 compressed-tensors base (kept int8 on the device) with adapters equals
    transformers' decompressed model with the same peft adapters."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from quant_checkpoints import write_quantized

    path = write_quantized(tiny_llama, str(tmp_path / "w8a16"), "w8a16")
    # One request at a time, 15 tokens: two rows and 16-token steps (three forward programs
    # for this model of its own, not seven).
    llm = lora_llm(path, max_num_seqs=2, max_num_batched_tokens=16)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    prompt = list(range(40, 55))
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for name in ("all", "qv"):
        out = llm.generate({"prompt_token_ids": prompt}, sp,
                           lora_request=requests(adapters)[name], use_tqdm=False)[0]
        model = PeftModel.from_pretrained(hf, adapters[name][0]).eval()
        assert list(out.outputs[0].token_ids) == oracle(model, prompt, NEW)[0], name
        hf = model.unload()
