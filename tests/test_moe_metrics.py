"""Expert-load counters (--enable-expert-load-metrics): the tokens the engine's steps routed to
each expert of each MoE layer equal a NumPy recount of transformers' router top-k over the very
tokens the engine computed (each prompt, then each generated token but the last); /metrics
shows them per layer and expert; without the flag they are absent; a dense model refuses it."""

from __future__ import annotations

import numpy as np
import pytest

from test_engine import GREEDY, NEW, mixed_prompts, small_llm, token_ids


@pytest.fixture(autouse=True)
def _fail_on_recompile(monkeypatch):
    monkeypatch.setenv("JAXLLM_FAIL_ON_RECOMPILE", "1")


def recount(path: str, sequences: list[list[int]], top_k: int) -> dict[int, np.ndarray]:
    """{MoE layer index: tokens routed to each expert}, from transformers' router logits (top-k
    of the logits is top-k of their softmax), recounted in NumPy."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = model.config
    only_dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    moe_layers = [i for i in range(cfg.num_hidden_layers)
                  if i not in only_dense and (i + 1) % step == 0]
    counts = {i: 0 for i in moe_layers}
    with torch.no_grad():
        for seq in sequences:
            out = model(torch.tensor([seq]), output_router_logits=True)
            assert len(out.router_logits) == len(moe_layers)
            for layer, logits in zip(moe_layers, out.router_logits):
                ids = np.argsort(-logits.reshape(len(seq), -1).numpy(), axis=-1,
                                 kind="stable")[:, :top_k]
                counts[layer] = counts[layer] + np.bincount(ids.ravel(), minlength=logits.shape[-1])
    return counts


@pytest.mark.parametrize("arch,kw", [
    pytest.param("mixtral", {}, id="mixtral"),
    # a dense layer between two MoE layers (layer labels 0 and 2); multi-step bursts sum
    # their steps' counts on the device
    pytest.param("qwen2_moe", {"num_scheduler_steps": 4}, id="qwen2moe-mixed-burst",
                 marks=pytest.mark.slow),  # ~20 s
])
def test_expert_load_equals_numpy_recount_of_router_topk(make_tiny_checkpoint, arch, kw):
    from serving.metrics import ServerMetrics

    path = make_tiny_checkpoint(arch)
    prompts = mixed_prompts(6, seed=11)
    llm = small_llm(path, enable_expert_load_metrics=True, enable_prefix_caching=False, **kw)
    outs = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                  use_tqdm=False))
    engine = llm.llm_engine
    # every computed token: a prompt, then each generated token but the last (never fed back)
    expected = recount(path, [p + o[:-1] for p, o in zip(prompts, outs)],
                       engine.model_config.num_experts_per_tok)
    load = engine.stats().expert_load
    assert sorted(load) == sorted(expected)
    for layer in expected:
        np.testing.assert_array_equal(load[layer], expected[layer], err_msg=f"layer {layer}")
    total = (sum(map(len, prompts)) + len(prompts) * (NEW - 1)) * \
        engine.model_config.num_experts_per_tok
    assert all(int(c.sum()) == total for c in load.values())  # padding tokens not counted

    text = ServerMetrics(engine, "m").exposition().decode()  # what GET /metrics serves
    for prefix in ("jaxllm", "vllm"):
        for layer, counts in load.items():
            for expert, n in enumerate(counts):
                assert (f'{prefix}:moe_expert_tokens_total{{expert="{expert}",layer="{layer}",'
                        f'model_name="m"}} {float(n)}') in text
    if arch == "qwen2_moe":
        assert 'layer="1"' not in text  # the dense layer routes nothing


def test_without_the_flag_no_expert_load(make_tiny_checkpoint):
    from serving.metrics import ServerMetrics

    llm = small_llm(make_tiny_checkpoint("mixtral"))
    llm.generate([{"prompt_token_ids": mixed_prompts(1)[0]}], GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.runner.expert_load is None and engine.stats().expert_load is None
    assert "moe_expert_tokens" not in ServerMetrics(engine, "m").exposition().decode()


def test_flag_refused_for_a_dense_model(tiny_llama, load):
    from jaxllm.config import ConfigError

    with pytest.raises(ConfigError, match="--enable-expert-load-metrics: .* no mixture-of-"):
        load(tiny_llama, enable_expert_load_metrics=True)
