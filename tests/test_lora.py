"""Multi-LoRA serving through `LLM`: peft adapters of several ranks and targets, and the base
model, in one batch with fewer device slots than adapters — each prompt's greedy tokens and
their logprobs equal transformers + peft on its own adapter (float32). Adapters are made here
with peft, their B matrices random (init_lora_weights=False), so each changes the output."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

from jaxllm import LLM, LoRARequest, SamplingParams
from jaxllm.config import ConfigError

NEW = 6
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> peft LoraConfig arguments: ranks 8, 4 (rsLoRA), 16; all modules, q/v, o/up/down.
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=ALL),
    "qv": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "oud": dict(r=16, lora_alpha=8, target_modules=["o_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(autouse=True)
def _fail_on_recompile(monkeypatch):
    monkeypatch.setenv("JAXLLM_FAIL_ON_RECOMPILE", "1")


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """{name: (folder, the peft model: the oracle)}."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    out = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **kw))
        path = str(tmp_path_factory.mktemp(f"lora_{name}"))
        model.save_pretrained(path)
        out[name] = (path, model.eval())
    out[None] = (None, base)
    return out


def requests(adapters) -> dict:
    return {name: LoRARequest(name, i + 1, adapters[name][0])
            for i, name in enumerate(ADAPTERS)}


def oracle(model, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, the whole sequence recomputed each token."""
    import torch

    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(new):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
            lp = torch.log_softmax(logits, -1)
            tok = int(lp.argmax())
            ids.append(tok)
            lps.append(float(lp[tok]))
    return ids[len(prompt):], lps


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
    base_tokens = {}
    for name, p, out in zip(names, prompts, outs):
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
    """One slot, two adapters: the second adapter's request waits for the first's to finish
    (it does not fail). The same prompt under two adapters and the base model never shares
    prefix-cache blocks: each result equals its own oracle, run after the others cached it."""
    llm = lora_llm(tiny_llama, max_loras=1, enable_prefix_caching=True)
    reqs = requests(adapters)
    prompt = list(range(5, 5 + 17))  # four full blocks of 4
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for name in ["all", "qv", None, "all"]:  # "all" last: a hit on its own blocks is fine
        out = llm.generate({"prompt_token_ids": prompt}, sp, lora_request=reqs.get(name),
                           use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == oracle(adapters[name][1], prompt, NEW)[0], name
    both = llm.generate([{"prompt_token_ids": prompt}] * 2, sp,
                        lora_request=[reqs["qv"], reqs["oud"]], use_tqdm=False)
    for name, out in zip(["qv", "oud"], both):
        assert list(out.outputs[0].token_ids) == oracle(adapters[name][1], prompt, NEW)[0]


def test_refusals_name_the_problem(tiny_llama, adapters, tmp_path):
    with pytest.raises(ConfigError, match="--max-loras.*needs --enable-lora"):
        LLM(tiny_llama, max_loras=2)
    with pytest.raises(ConfigError, match="--pipeline-parallel-size.*--enable-lora"):
        LLM(tiny_llama, enable_lora=True, pipeline_parallel_size=2)
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
