"""Shared fixtures: tiny random-weight transformers checkpoints (with a real tokenizer) and a
small paged-attention driver that runs a jaxllm model without the engine.

Checkpoints are built once per session. Weights are drawn wider than transformers' init so the
logits are well separated and greedy decoding is a meaningful comparison.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

import numpy as np
import pytest

# JAX's persistent compilation cache stays off, as users run by default: jaxllm's own
# executable cache ($JAXLLM_CACHE_DIR) keeps the engine's programs across tests and processes,
# and with JAX's on, the engine's compiles must run one at a time (a load from it racing a
# lowering crashed the process: jaxllm/worker/executable_cache.py), which cost more than it saved.

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen2_moe",
         "qwen3_moe", "granite", "granitemoe", "olmoe", "phi3", "gemma3_mm")
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
           "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM", "granite": "GraniteForCausalLM",
           "granitemoe": "GraniteMoeForCausalLM", "olmoe": "OlmoeForCausalLM",
           "phi3": "Phi3ForCausalLM", "gemma3_mm": "Gemma3ForConditionalGeneration"}
# Granite's multipliers, none of them one (transformers' defaults are all one).
_GRANITE = dict(embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.2,
                logits_scaling=4.0)
# Mixture of experts: 8 experts of FFN 32, top-2 (the tests override these).
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
VOCAB = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = ["The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
           "Hello world, how are you today? I am fine, thank you. What is 2 + 2? It is 4.",
           "Once upon a time there was a tiny model that learned to speak in JAX."]


def _hf_config(arch: str, overrides: dict):
    """A small config per architecture: 4 query heads on 2 KV heads unless overridden."""
    import transformers as tr

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
    if arch == "llama":
        cfg = tr.LlamaConfig(**{**common, **overrides})
    elif arch == "mistral":
        cfg = tr.MistralConfig(**{**common, "sliding_window": 12, **overrides})
    elif arch == "qwen2":
        cfg = tr.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
    elif arch == "qwen3":
        cfg = tr.Qwen3Config(**{**common, "head_dim": 24, **overrides})
    elif arch == "gemma2":
        cfg = tr.Gemma2Config(**{
            **common, "num_hidden_layers": 3, "head_dim": 16, "tie_word_embeddings": True,
            "sliding_window": 8, "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 20.0, **overrides})
    elif arch == "gemma3":
        cfg = tr.Gemma3TextConfig(**{
            **common, "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 16, "tie_word_embeddings": True, "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24, "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
            **overrides})
    elif arch == "mixtral":
        cfg = tr.MixtralConfig(**{**common, "intermediate_size": 32, "num_local_experts": 8,
                                  "num_experts_per_tok": 2, **overrides})
    elif arch == "qwen2_moe":  # a shared expert; layer 1 dense (mlp_only_layers)
        cfg = tr.Qwen2MoeConfig(**{**common, **_MOE, "num_hidden_layers": 3,
                                   "shared_expert_intermediate_size": 48,
                                   "mlp_only_layers": [1], **overrides})
    elif arch == "qwen3_moe":
        cfg = tr.Qwen3MoeConfig(**{**common, **_MOE, "head_dim": 24, "norm_topk_prob": True,
                                   **overrides})
    elif arch == "granite":
        cfg = tr.GraniteConfig(**{**common, **_GRANITE, **overrides})
    elif arch == "granitemoe":
        cfg = tr.GraniteMoeConfig(**{**common, **_GRANITE, "intermediate_size": 32,
                                     "num_local_experts": 8, "num_experts_per_tok": 2,
                                     **overrides})
    elif arch == "olmoe":
        cfg = tr.OlmoeConfig(**{**common, "intermediate_size": 32, "num_experts": 8,
                                "num_experts_per_tok": 2, **overrides})
    elif arch == "phi3":  # LongRoPE past 64 positions; factors sized by partial_rotary_factor
        partial = overrides.pop("partial_rotary_factor", 1.0)
        n = int(16 * partial) // 2  # head_dim 16
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                "original_max_position_embeddings": 64,
                "short_factor": [1.0 + 0.25 * i for i in range(n)],
                "long_factor": [2.0 + 1.5 * i for i in range(n)]}
        cfg = tr.Phi3Config(**{**common, "max_position_embeddings": 128,
                               "original_max_position_embeddings": 64,
                               "rope_parameters": rope, **overrides})
    elif arch == "gemma3_mm":  # the gemma3 text model inside a tiny vision-language model
        text = {**_hf_config("gemma3", overrides).to_dict(), "architectures": None}
        cfg = tr.Gemma3Config(text_config=text, mm_tokens_per_image=4, vision_config=dict(
            hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14))
    else:
        raise ValueError(f"unknown test architecture {arch!r}; one of {ARCHS}")
    cfg.architectures = [CLASSES[arch]]
    return cfg


def _randomize(model, gemma: bool, seed: int) -> None:
    """Weights wide enough for well-separated logits; norms near their identity value."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise * (0.5 if gemma else 1.0))
            else:
                p.copy_(noise * 1.5 / p.shape[-1] ** 0.5)


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def make_tiny_checkpoint(tmp_path_factory):
    """make_tiny_checkpoint(arch, **config_overrides) -> folder with config.json, safetensors
    weights (float32), generation_config.json and a tokenizer with a chat template."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    # The models are tiny: a second torch thread only fights XLA's pool (10x slower oracle).
    torch.set_num_threads(1)
    cache: dict[str, str] = {}
    tokenizer = []

    def make(arch: str, seed: Optional[int] = None, **overrides) -> str:
        """`seed` fixes the random weights whatever was built before in the session (by
        default they depend on how many checkpoints came first)."""
        key = json.dumps([arch, seed, overrides], sort_keys=True)
        if key in cache:
            return cache[key]
        if not tokenizer:
            tokenizer.append(_train_tokenizer())
        tok = tokenizer[0]
        cfg = _hf_config(arch, overrides)
        cfg.bos_token_id = cfg.pad_token_id = tok.pad_token_id
        cfg.eos_token_id = tok.eos_token_id
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _randomize(model, arch.startswith("gemma"), seed=len(cache) if seed is None else seed)
        model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id,
                                                   eos_token_id=cfg.eos_token_id,
                                                   pad_token_id=cfg.pad_token_id)
        path = str(tmp_path_factory.mktemp(f"tiny_{arch}"))
        model.save_pretrained(path)
        tok.save_pretrained(path)
        cache[key] = path
        return path

    return make


@pytest.fixture(scope="session")
def tiny_llama(make_tiny_checkpoint) -> str:
    return make_tiny_checkpoint("llama")


@pytest.fixture(scope="session", autouse=True)
def _tiny_llama_first(tiny_llama) -> None:
    """The suite's default model is the session's first checkpoint, so its weights (seed 0)
    are the same whichever tests a run selects: a test that built another checkpoint first
    shifted them, and the structured-output tests' checks (Python's `re` and `json` on what
    llguidance allowed) hold for some random weights and not others."""


# --- a minimal paged-attention driver (the engine's job, reduced to what tests need) ----------

class PagedRunner:
    """Runs a jaxllm model over a ragged batch with its own block tables and KV cache.

    Each sequence owns enough pages for `max_len` tokens, allocated in reverse order so tables
    are not contiguous. Every step is padded to `num_tokens` tokens plus one padding sequence,
    as the engine pads to buckets, so prefill and decode share one compiled step.
    """

    def __init__(self, model, block_size: int, num_seqs: int, max_len: int, num_tokens: int,
                 relayout: bool = True):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from jaxllm.layers.attention import empty_kv_caches, kv_cache_shardings

        cfg = model.cfg
        self.bs, self.num_tokens = block_size, num_tokens
        self.per_seq = -(-max_len // block_size)
        n_blocks = num_seqs * self.per_seq
        self.tables = np.arange(n_blocks, dtype=np.int32)[::-1].reshape(num_seqs, -1).copy()
        shapes = model.kv_cache_shapes(n_blocks, block_size)
        # on the weights' mesh, committed like the step's output (else the 2nd step recompiles)
        shardings = kv_cache_shardings(shapes, model.embed[...].sharding.mesh)
        self.cache = empty_kv_caches(shapes, cfg.jnp_dtype, shardings)
        self.kv_lens = np.zeros(num_seqs, np.int32)
        graphdef, self.state = nnx.split(model)
        self.graphdef = graphdef
        if relayout:  # the layout the backend's ops read, as the engine's runner has it (a
            # copy: relayout consumes the arrays it changes, and tests reuse their model)
            copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s))
            self.state = model.backend.relayout(copy(self.state), cfg)

        def step(state, cache, ids, pos, md):
            m = nnx.merge(graphdef, state)
            hidden, cache = m(cache, ids, pos, md)
            return m.compute_logits(hidden), cache

        self._step = jax.jit(step, donate_argnums=1)

    def step(self, seqs: list[int], chunks: list[list[int]]) -> list[np.ndarray]:
        """Append `chunks[i]` to sequence `seqs[i]`; returns each chunk's logits [len, V]."""
        import jax.numpy as jnp

        from jaxllm.layers.attention import AttentionMetadata

        q_lens = [len(c) for c in chunks]
        n = sum(q_lens)
        T = self.num_tokens
        assert n < T, "leave room for padding tokens"
        ids = np.zeros(T, np.int32)
        pos = np.zeros(T, np.int32)
        slots = np.full(T, -1, np.int32)
        S = len(seqs) + 1  # plus one padding sequence
        kv = np.zeros(S, np.int32)
        tables = np.zeros((S, self.per_seq), np.int32)
        t = 0
        for i, (s, chunk) in enumerate(zip(seqs, chunks)):
            start = self.kv_lens[s]
            p = start + np.arange(len(chunk))
            ids[t:t + len(chunk)] = chunk
            pos[t:t + len(chunk)] = p
            slots[t:t + len(chunk)] = self.tables[s][p // self.bs] * self.bs + p % self.bs
            self.kv_lens[s] += len(chunk)
            kv[i], tables[i] = self.kv_lens[s], self.tables[s]
            t += len(chunk)
        cu = np.concatenate([[0], np.cumsum(q_lens), [n]]).astype(np.int32)
        md = AttentionMetadata(jnp.asarray(slots), jnp.asarray(kv), jnp.asarray(tables),
                               jnp.asarray(cu), jnp.asarray([len(seqs)], np.int32))
        logits, self.cache = self._step(self.state, self.cache, jnp.asarray(ids),
                                        jnp.asarray(pos), md)
        logits = np.asarray(logits)
        return [logits[cu[i]:cu[i + 1]] for i in range(len(seqs))]


def paged_greedy(model, prompts: list[list[int]], new_tokens: int, block_size: int = 4
                 ) -> tuple[list[np.ndarray], list[list[np.ndarray]], list[list[int]]]:
    """Prefill all prompts in one ragged batch, then decode them together greedily.

    Returns (prefill logits per prompt [len, V], decode-step logits per prompt, new tokens).
    """
    n = sum(map(len, prompts))
    runner = PagedRunner(model, block_size, len(prompts), max(map(len, prompts)) + new_tokens,
                         num_tokens=1 << n.bit_length())
    seqs = list(range(len(prompts)))
    prefill = runner.step(seqs, prompts)
    steps = [[p[-1]] for p in prefill]
    tokens = [[int(p[-1].argmax())] for p in prefill]
    for _ in range(new_tokens - 1):
        out = runner.step(seqs, [[t[-1]] for t in tokens])
        for s, lg in enumerate(out):
            steps[s].append(lg[0])
            tokens[s].append(int(lg[0].argmax()))
    return prefill, steps, tokens


@pytest.fixture(scope="session")
def greedy():
    """The paged greedy driver (`paged_greedy`) as a fixture."""
    return paged_greedy


def run_with_host_devices(n: int, argv: list[str], timeout: int = 900):
    """python argv in a subprocess with n virtual CPU devices (JAX fixes its device count at
    import) and this checkout's code first on the path; the CompletedProcess."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *argv], env=env, cwd=root, capture_output=True,
                          text=True, timeout=timeout)


def run_on_isa(march: str, needs: set, code: str) -> None:
    """`python -c code` with the CPU kernels built for -march=`march` (skipped, naming the
    missing CPU flags, where this CPU lacks `needs`): the child passed and built that ISA."""
    with open("/proc/cpuinfo") as f:
        flags = next((set(line.split(":", 1)[1].split()) for line in f
                      if line.startswith("flags")), set())
    missing = needs - flags
    if missing:
        pytest.skip(f"this CPU cannot run -march={march} code (no {', '.join(sorted(missing))})")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAXLLM_CPU_MARCH=march,
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here),
                                           os.environ.get("PYTHONPATH", "")]))
    code += "from pallas_kernels import cpu_ffi; print('FLAGS', ' '.join(cpu_ffi.flags()))\n"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"-march={march}" in res.stdout


def sharded_params(model) -> list[str]:
    """The model's parameters (as "layers/0/qkv" paths) split over the mesh's `model` axis."""
    import jax
    from flax import nnx

    return sorted("/".join(map(str, p)) for p, v in nnx.to_flat_state(nnx.state(model))
                  if "model" in jax.tree.leaves(tuple(v.get_value().sharding.spec)))


def greedy_record(model, prompts: list[list[int]], new_tokens: int) -> dict:
    """`paged_greedy` as JSON-ready lists, with the number of devices the model is on."""
    prefill, steps, tokens = paged_greedy(model, prompts, new_tokens)
    return {"devices": len(model.embed[...].sharding.device_set),
            "prefill": np.concatenate(prefill).tolist(), "steps": np.array(steps).tolist(),
            "tokens": tokens}


def tp_greedy_report(path: str) -> dict:
    """A tensor-parallel child's report (run_with_host_devices, 2 devices): the model at TP 1
    and TP 2, each with its sharded parameters and `greedy_record` of two prompts."""
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in (7, 19)]
    report = {}
    for name, tp in (("tp1", 1), ("tp2", 2)):
        model, _, _ = load_tiny(path, tp=tp)
        report[name] = {"sharded": sharded_params(model), **greedy_record(model, prompts, 24)}
    return report


def load_tiny(path: str, tp: int = 1, **engine_args):
    """load_model on a `tp`-device mesh, float32 unless `dtype` is given, no progress bar."""
    from jaxllm.config import EngineArgs
    from jaxllm.loader.loader import load_model
    from jaxllm.parallel.mesh import make_mesh

    mesh = make_mesh(tp)
    config = EngineArgs(model=path, use_tqdm_on_load=False, tensor_parallel_size=tp,
                        **{"dtype": "float32", **engine_args}).create_engine_config()
    model, cfg = load_model(config.load, config.model, mesh)
    return model, cfg, mesh


@pytest.fixture(scope="session")
def load():
    """`load_tiny` as a fixture: (path, tp=1, **engine_args) -> (model, ModelConfig, mesh)."""
    return load_tiny


# --- a `jaxllm serve` process of the tiny model, one per test module that asks ---------------

@pytest.fixture(scope="module")
def server(tiny_llama):
    """The tiny model served with an API key (tests/server_process.py); a module may define
    its own `server` instead."""
    from server_process import serve_tiny
    yield from serve_tiny(tiny_llama)


@pytest.fixture(scope="module")
def client(server):
    from server_process import openai_client
    return openai_client(server)


@pytest.fixture(scope="module")
def http(server):
    from server_process import http_client
    yield from http_client(server)


# --- failure reports ------------------------------------------------------------------------

@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used a server subprocess (a `server` fixture with `output()`) gets
    the server's log tail and exit status in its report: CI shows only the report, and "server
    disconnected" says nothing about why."""
    report = yield
    server = getattr(item, "funcargs", {}).get("server")
    if report.failed and hasattr(server, "output"):
        proc = getattr(server, "proc", None)
        status = proc.poll() if proc is not None else None
        report.sections.append((f"server log (exit status {status})", server.output()))
    return report


_SPREAD_WEIGHTS = (1, 3, 5, 7, 11, 13, 17, 19)


def spread_grid(*axes, keep: int) -> list:
    """pytest.params of the product of `axes` (each a list of values; a tuple value fills
    several argnames), all but about 1/keep of them marked slow. The default suite keeps the
    combinations whose value indices, weighted 1, 3, 5, 7, ..., sum to 0 mod `keep`; collection
    fails if that leaves some value of an axis out, so the default suite meets every value and
    the slow run covers the whole grid."""
    import itertools

    params, kept = [], [set() for _ in axes]
    for idx in itertools.product(*(range(len(a)) for a in axes)):
        values = []
        for a, i in zip(axes, idx):
            values += list(a[i]) if isinstance(a[i], tuple) else [a[i]]
        default = sum(w * i for w, i in zip(_SPREAD_WEIGHTS, idx)) % keep == 0
        if default:
            for seen, i in zip(kept, idx):
                seen.add(i)
        params.append(pytest.param(*values, marks=() if default else (pytest.mark.slow,)))
    missing = [n for n, (a, seen) in enumerate(zip(axes, kept)) if len(seen) < len(a)]
    if missing:
        raise ValueError(f"spread_grid(keep={keep}) leaves values of axes {missing} out of the "
                         "default suite: use a smaller keep")
    return params
