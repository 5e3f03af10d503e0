"""Speculative decoding with the checkpoint's own MTP layer (issue 47; vLLM's "deepseek_mtp"):
greedy outputs equal plain decoding token for token, a checkpoint whose MTP layer reproduces
the target's next-token rule gets its drafts accepted, and the refusals.

transformers drops a DeepSeek-V3 checkpoint's MTP layer, so these tests write its
`model.layers.{L}.*` tensors into the saved safetensors themselves (`with_mtp`).

The "predictable" checkpoint: one decoder layer whose attention output is zeroed (o_proj = 0),
so the target's greedy next token is a function g of the current token alone, and embedding
rows scaled to RMS 1. Its MTP layer copies that layer, its final norm as shared_head.norm,
enorm / hnorm ones and eh_proj = [I | 0] (the token path only): the MTP row of (t_{p+1}, h_p)
then computes the target's own layer on t_{p+1}'s embedding (enorm(e) = e up to the 1e-6
epsilon) and drafts g(t_{p+1}), the target's next token; a draft step fed the previous draft
drafts g(draft). So every draft must be accepted, up to argmax ties broken differently by
that rounding: the test asks for >= 90 % (a random MTP layer over a 512-token vocabulary
accepts a small share).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError
from jaxllm.spec_decode.config import SpeculativeConfig
from test_spec_engine import plain
from deepseek_checkpoints import ARCHS, build
from test_deepseek import GLM4_MOE, V3

MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 2}
V3_ARCH = "DeepseekV3ForCausalLM"
# One dense layer; the MTP layer (index 1 < first_k_dense_replace) is dense too: cheap to
# compile (the slow tests' MTP layers are MoE ones).
PREDICTABLE = dict(V3, num_hidden_layers=1, first_k_dense_replace=2)


@pytest.fixture(scope="module")
def checkpoint(make_tiny_checkpoint, tmp_path_factory):
    """checkpoint(arch, **config) -> a float32 checkpoint folder of DeepseekV3ForCausalLM or
    Glm4MoeForCausalLM (tests/deepseek_checkpoints.py); no MTP tensors (transformers saves
    none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tiny_checkpoint("llama"))
    version = {arch: v for v, arch in ARCHS.items()}
    cache = {}

    def make(arch: str, **kw) -> str:
        key = json.dumps([arch, kw], sort_keys=True)
        if key not in cache:
            cache[key] = build(version[arch], tok, str(tmp_path_factory.mktemp("tiny_mtp")),
                               seed=len(cache), **kw)
        return cache[key]

    return make


def with_mtp(src: str, dst, *, predictable: bool = False, own_copies: bool = False,
             seed: int = 0) -> str:
    """A copy of checkpoint `src` with an MTP layer model.layers.{L}: a copy of its last
    layer, shared_head.norm its final norm; eh_proj [I | 0] when `predictable` (see the
    module docstring: the attention zeroed, embeddings at RMS 1), else random. own_copies:
    the layer carries its own embed_tokens and shared_head.head (copies of the target's)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    L, E = cfg["num_hidden_layers"], cfg["hidden_size"]
    t = load_file(str(dst / "model.safetensors"))
    if predictable:
        for i in range(L):
            t[f"model.layers.{i}.self_attn.o_proj.weight"] *= 0
        emb = t["model.embed_tokens.weight"]
        t["model.embed_tokens.weight"] = emb / np.sqrt((emb * emb).mean(1, keepdims=True))
    last = f"model.layers.{L - 1}."
    for name in list(t):
        if name.startswith(last):
            t[f"model.layers.{L}." + name[len(last):]] = t[name].copy()
    p = f"model.layers.{L}."
    rng = np.random.default_rng(seed)
    eh = (np.concatenate([np.eye(E), np.zeros((E, E))], 1) if predictable
          else rng.normal(0, 0.1, (E, 2 * E)))
    t.update({p + "enorm.weight": np.ones(E, np.float32),
              p + "hnorm.weight": np.ones(E, np.float32),
              p + "eh_proj.weight": eh.astype(np.float32),
              p + "shared_head.norm.weight": t["model.norm.weight"].copy()})
    if own_copies:
        t[p + "embed_tokens.weight"] = t["model.embed_tokens.weight"].copy()
        t[p + "shared_head.head.weight"] = t["lm_head.weight"].copy()
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def mtp_llm(path: str, spec: dict = MTP, **kw) -> LLM:
    # Few token buckets: the target and the MTP layer compile a program for each.
    args = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                use_tqdm_on_load=False, seed=0, disable_log_stats=True,
                speculative_config=spec)
    return LLM(path, **{**args, **kw})


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)  # at least 2 tokens: row 0's embedding is masked
    return [rng.integers(3, 500, size=int(rng.integers(2, 40))).tolist() for _ in range(n)]


def generate(llm, ps, n: int = 16):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def predictable(checkpoint, tmp_path_factory):
    return with_mtp(checkpoint(V3_ARCH, **PREDICTABLE),
                    tmp_path_factory.mktemp("mtp") / "predictable", predictable=True)


@pytest.fixture(scope="module")
def llm(predictable):
    return mtp_llm(predictable, max_num_seqs=2)  # fewer step shapes: fewer programs


def test_mtp_drafts_are_accepted_and_outputs_equal_plain_decoding(llm):
    ps = prompts(6, seed=1)
    with plain(llm):
        expected = generate(llm, ps)
    eng = llm.llm_engine
    assert generate(llm, ps) == expected
    sd = eng.stats().spec_decode
    assert sd.num_draft_tokens > 0
    rate = sd.num_accepted_tokens / sd.num_draft_tokens
    assert rate >= 0.9, (rate, sd)
    assert len(sd.num_accepted_tokens_per_pos) == 2 and sd.num_accepted_tokens_per_pos[1] > 0


def test_config_accepts_the_names_and_refuses_other_fields():
    for name in ("deepseek_mtp", "mtp"):
        c = SpeculativeConfig.parse({"method": name, "num_speculative_tokens": 3})
        assert c.method == name and c.num_speculative_tokens == 3
    for extra in ({"model": "x"}, {"prompt_lookup_max": 3}):
        with pytest.raises(ValueError, match=f"{next(iter(extra))}.*'mtp'"):
            SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 1, **extra})


def test_refused_without_the_mtp_layer(checkpoint, tmp_path):
    """transformers saves no MTP tensors (its config still says num_nextn_predict_layers=1):
    the engine refuses it naming the method, before any program compiles."""
    with pytest.raises(ConfigError, match="'deepseek_mtp'.*no model.layers.1"):
        mtp_llm(checkpoint(V3_ARCH, **PREDICTABLE))


def test_refusals_name_the_method(checkpoint, tiny_llama, tmp_path):
    """mtp_source (what start-up asks first): a config of num_nextn_predict_layers 0, or 2,
    and an architecture without an MTP layer."""
    from jaxllm.config import EngineArgs
    from jaxllm.loader.loader import hf_config
    from jaxllm.loader.mtp_weights import mtp_source
    from jaxllm.models.model_config import ModelConfig

    def source(path, method="mtp"):
        load = EngineArgs(model=str(path)).create_engine_config().load
        return mtp_source(load, ModelConfig.from_hf(hf_config(str(path))), method)

    src = checkpoint(V3_ARCH, **PREDICTABLE)
    cfg = json.loads((Path(src) / "config.json").read_text())
    for n in (0, 2):
        dst = tmp_path / str(n)
        shutil.copytree(src, dst)
        (dst / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=n)))
        with pytest.raises(ConfigError, match=f"'mtp'.*num_nextn_predict_layers={n}"):
            source(dst)
    with pytest.raises(ConfigError, match="'deepseek_mtp'.*LlamaForCausalLM has none"):
        source(tiny_llama, "deepseek_mtp")


@pytest.mark.slow  # minutes: two engines of a 3-layer model and their MTP programs
@pytest.mark.parametrize("k,own", [(1, False), (3, True)])
def test_random_mtp_layer_outputs_equal_plain_decoding(checkpoint, tmp_path, k, own):
    """A 3-layer model (MLA, a dense then MoE layers) with a random MTP layer (its own
    embedding and head copies or not): greedy outputs with its drafts equal plain decoding,
    with chunked prefill, prefix caching, preemption (a 40-block cache) and async
    scheduling."""
    path = with_mtp(checkpoint(V3_ARCH, **V3), tmp_path / "mtp", own_copies=own, seed=k)
    llm = mtp_llm(path, {"method": "deepseek_mtp", "num_speculative_tokens": k},
                  max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128,
                  num_gpu_blocks_override=40, enable_prefix_caching=True,
                  async_scheduling=True)
    ps = prompts(10, seed=2)
    ps += [ps[0] + p for p in prompts(2, seed=3)]  # shared prefixes
    with plain(llm):
        expected = generate(llm, ps, 20)
    assert generate(llm, ps, 20) == expected
    eng = llm.llm_engine
    assert eng.scheduler.num_preemptions > 0
    assert eng.stats().spec_decode.num_draft_tokens > 0


@pytest.mark.slow  # an engine and its MTP programs
def test_glm4_moe_mtp_layer_drafts(checkpoint, tmp_path):
    """GLM-4.5's MTP layer (grouped-query attention with biases and q/k norms, partial
    rotary; the same checkpoint layout): the predictable construction's drafts are accepted
    and the outputs equal plain decoding."""
    src = checkpoint("Glm4MoeForCausalLM", **dict(GLM4_MOE, num_hidden_layers=1,
                                                  first_k_dense_replace=0))
    llm = mtp_llm(with_mtp(src, tmp_path / "glm", predictable=True),
                  {"method": "mtp", "num_speculative_tokens": 2})
    ps = prompts(4, seed=4)
    with plain(llm):
        expected = generate(llm, ps)
    assert generate(llm, ps) == expected
    sd = llm.llm_engine.stats().spec_decode
    assert sd.num_draft_tokens > 0 and sd.num_accepted_tokens >= 0.9 * sd.num_draft_tokens


@pytest.mark.slow  # a subprocess on 2 virtual devices: an engine and its MTP programs
def test_tensor_parallel_mtp_equals_plain_decoding(predictable):
    """tp=2 (the MTP layer's heads split as the target's, its cache sharded alike): the
    drafts are accepted and the outputs equal plain decoding on the same engine."""
    from conftest import run_with_host_devices

    proc = run_with_host_devices(2, [__file__, predictable])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run["mtp"] == run["plain"]
    assert run["drafts"] > 0 and run["accepted"] >= 0.9 * run["drafts"]


def _tp_child(path: str) -> dict:
    llm = mtp_llm(path, tensor_parallel_size=2)
    ps = prompts(4, seed=5)
    with plain(llm):
        expected = generate(llm, ps)
    got = generate(llm, ps)
    sd = llm.llm_engine.stats().spec_decode
    return {"plain": expected, "mtp": got, "drafts": sd.num_draft_tokens,
            "accepted": sd.num_accepted_tokens}


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(_tp_child(sys.argv[1])))
