"""Tiny random Qwen3-Next checkpoints and a paged runner with state slots for them."""

import json

import numpy as np

# 4 layers, linear (gated DeltaNet) and full attention mixed; 2 key heads serving 4 value heads.
DENSE = dict(vocab_size=512, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=12, linear_conv_kernel_dim=4, num_experts=0,
             layer_types=["linear_attention", "full_attention", "linear_attention",
                          "linear_attention"],
             max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.25})

# A one-block vision tower for the multimodal (ForConditionalGeneration) checkpoints.
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
              patch_size=4, num_position_embeddings=16)


def make_qwen3_next(tmp_path_factory, tok, cache: dict, arch: str = "Qwen3NextForCausalLM",
                    **kw) -> str:
    """A float32 Qwen3-Next (or Qwen3.5: arch "Qwen3_5ForCausalLM") checkpoint of DENSE
    updated by kw, random weights (norm weights near zero: the model's norms scale by 1 + w;
    A_log and dt_bias random too)."""
    import torch
    import transformers as tr

    key = json.dumps([arch, kw], sort_keys=True)
    if key in cache:
        return cache[key]
    config_cls = {"Qwen3_5ForCausalLM": tr.Qwen3_5TextConfig,
                  "Qwen3_5MoeForCausalLM": tr.Qwen3_5MoeTextConfig}.get(arch, tr.Qwen3NextConfig)
    ids = dict(bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    text = {**DENSE, **kw}
    if arch.startswith("Qwen3_5Moe"):  # every MLP sparse: its config has no dense width
        del text["intermediate_size"]
    if arch.endswith("ForConditionalGeneration"):  # a tiny vision tower beside the text model
        multimodal = (tr.Qwen3_5MoeConfig if arch.startswith("Qwen3_5Moe")
                      else tr.Qwen3_5Config)
        cfg = multimodal(text_config={**text, **ids}, vision_config=VISION,
                         tie_word_embeddings=False)
    else:
        cfg = config_cls(**text, **ids)
    cfg.architectures = [arch]
    torch.manual_seed(0)
    auto = (tr.AutoModelForImageTextToText if arch.endswith("ForConditionalGeneration")
            else tr.AutoModelForCausalLM)
    model = auto.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(len(cache))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "norm" in name:
                p.copy_(0.1 * noise)
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(noise * 1.5 / fan_in ** 0.5)
    path = str(tmp_path_factory.mktemp("tiny_qwen3_next"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    cache[key] = path
    return path


class StateRunner:
    """A ragged paged runner (as conftest's PagedRunner) whose sequences also hold a state
    slot: sequence s uses slot slots[s] (a permutation, so slots are not the row order)."""

    def __init__(self, model, block_size: int, num_seqs: int, max_len: int, num_tokens: int):
        import jax
        from flax import nnx

        from jaxllm.layers.attention import empty_kv_caches, kv_cache_shardings

        self.bs, self.num_tokens = block_size, num_tokens
        self.per_seq = -(-max_len // block_size)
        n_blocks = num_seqs * self.per_seq
        self.tables = np.arange(n_blocks, dtype=np.int32)[::-1].reshape(num_seqs, -1).copy()
        self.slots = np.arange(num_seqs, dtype=np.int32)[::-1].copy()
        shapes = model.kv_cache_shapes(n_blocks, block_size, state_slots=num_seqs)
        shardings = kv_cache_shardings(shapes, model.embed[...].sharding.mesh)
        self.cache = empty_kv_caches(shapes, model.cfg.jnp_dtype, shardings)
        self.kv_lens = np.zeros(num_seqs, np.int32)
        graphdef, state = nnx.split(model)
        self.state = model.backend.relayout(jax.jit(lambda s: jax.tree.map(
            lambda x: x.copy(), s))(state), model.cfg)

        def step(state, cache, ids, pos, md):
            m = nnx.merge(graphdef, state)
            hidden, cache = m(cache, ids, pos, md)
            return m.compute_logits(hidden), cache

        self._step = jax.jit(step, donate_argnums=1)

    def reset(self, s: int) -> None:
        self.kv_lens[s] = 0

    def step(self, seqs: list[int], chunks: list[list[int]]) -> list[np.ndarray]:
        import jax.numpy as jnp

        from jaxllm.layers.attention import AttentionMetadata

        q_lens = [len(c) for c in chunks]
        n, T = sum(q_lens), self.num_tokens
        assert n < T
        ids, pos = np.zeros(T, np.int32), np.zeros(T, np.int32)
        slots = np.full(T, -1, np.int32)
        S = len(seqs) + 1
        kv, tables = np.zeros(S, np.int32), np.zeros((S, self.per_seq), np.int32)
        state_slots = np.full(S, -1, np.int32)
        t = 0
        for i, (s, chunk) in enumerate(zip(seqs, chunks)):
            p = self.kv_lens[s] + np.arange(len(chunk))
            ids[t:t + len(chunk)], pos[t:t + len(chunk)] = chunk, p
            slots[t:t + len(chunk)] = self.tables[s][p // self.bs] * self.bs + p % self.bs
            self.kv_lens[s] += len(chunk)
            kv[i], tables[i], state_slots[i] = self.kv_lens[s], self.tables[s], self.slots[s]
            t += len(chunk)
        cu = np.concatenate([[0], np.cumsum(q_lens), [n]]).astype(np.int32)
        md = AttentionMetadata(jnp.asarray(slots), jnp.asarray(kv), jnp.asarray(tables),
                               jnp.asarray(cu), jnp.asarray([len(seqs)], np.int32),
                               state_slots=jnp.asarray(state_slots))
        logits, self.cache = self._step(self.state, self.cache, jnp.asarray(ids),
                                        jnp.asarray(pos), md)
        logits = np.asarray(logits)
        return [logits[a:b] for a, b in zip(cu[:-2], cu[1:-1])]
