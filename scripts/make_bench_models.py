"""Build the benchmark model folders once, so every engine reads the very same safetensors.

    python scripts/make_bench_models.py --models smollm2 llama124m \
        --cache-dir ~/.cache/jaxllm/bench_models

smollm2: the default SmolLM2-135M GGUF dequantized to a float32 safetensors folder (by
scripts/convert_smollm2_to_safetensors.py). llama124m: a seeded random-weight Llama (hidden 768,
12 layers, 12 heads / 4 KV heads, FFN 2048, vocab 32000) with SmolLM2's tokenizer copied in:
vLLM needs a tokenizer even for token-id prompts, and neither prompts (ids < 32000) nor outputs
(the model has 32000 logits) ever reach the tokenizer's ids above 32000.
mixtral-tiny / qwen3moe-tiny: seeded random mixtures of experts of the same kind (hidden 512,
8 layers, 8 heads / 4 KV heads, 8 experts of FFN 1024, top-2, vocab 32000), built on demand
(`--models mixtral-tiny qwen3moe-tiny`; not in the default set).
llama124m-draft2: llama124m's config with 2 layers, seeded alike (same vocab and tokenizer): a
draft model for speculative decoding benchmarks (scripts/bench_spec.py --draft), built on demand.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxllm", "bench_models")
MODELS = ("smollm2", "llama124m", "llama124m-draft2", "mixtral-tiny", "qwen3moe-tiny")
DEFAULT_MODELS = ("smollm2", "llama124m")
_COMMON = dict(max_position_embeddings=2048, rms_norm_eps=1e-5, vocab_size=32000,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")


def is_built(folder: str) -> bool:
    """A folder counts as built once weights, config and a tokenizer are all there."""
    return all(os.path.exists(os.path.join(folder, f))
               for f in ("config.json", "model.safetensors", "tokenizer.json"))


def build_smollm2(folder: str) -> None:
    """Run the existing converter in a subprocess (it imports torch + transformers + gguf)."""
    subprocess.run([sys.executable, os.path.join(HERE, "convert_smollm2_to_safetensors.py"),
                    "--out", folder, "--dtype", "float32"], check=True)


def random_config(name: str):
    """The transformers config of a random benchmark model."""
    import transformers as tr

    if name.startswith("llama124m"):
        layers = 2 if name == "llama124m-draft2" else 12
        return tr.LlamaConfig(hidden_size=768, num_hidden_layers=layers, num_attention_heads=12,
                              num_key_value_heads=4, intermediate_size=2048,
                              architectures=["LlamaForCausalLM"], **_COMMON)
    moe = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=4, num_experts_per_tok=2, **_COMMON)
    if name == "mixtral-tiny":
        return tr.MixtralConfig(intermediate_size=1024, num_local_experts=8,
                                architectures=["MixtralForCausalLM"], **moe)
    return tr.Qwen3MoeConfig(intermediate_size=1024, moe_intermediate_size=1024, num_experts=8,
                             head_dim=64, norm_topk_prob=True,
                             architectures=["Qwen3MoeForCausalLM"], **moe)


def build_random(name: str, folder: str, tokenizer_from: str) -> None:
    """Seeded random model saved in float32, with SmolLM2's tokenizer files beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = random_config(name)
    config.rope_theta = 10000.0  # transformers 5.x writes only rope_parameters; older readers want this
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_from, name)
        if os.path.exists(src):
            shutil.copy(src, folder)


def ensure_models(names, cache_dir: str = DEFAULT_CACHE) -> dict:
    """Build whatever is missing; return {name: folder}. The random models borrow smollm2's
    tokenizer."""
    paths = {n: os.path.join(cache_dir, n) for n in MODELS}
    wanted = set(names) | ({"smollm2"} if set(names) - {"smollm2"} else set())
    for name in MODELS:
        if name not in wanted or is_built(paths[name]):
            continue
        tmp = paths[name] + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        print(f"building {name} in {paths[name]} ...", file=sys.stderr, flush=True)
        if name == "smollm2":
            build_smollm2(tmp)
        else:
            build_random(name, tmp, paths["smollm2"])
        shutil.rmtree(paths[name], ignore_errors=True)
        os.rename(tmp, paths[name])  # atomic: a half-written folder never looks built
    return {n: paths[n] for n in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(DEFAULT_MODELS))
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE)
    args = parser.parse_args()
    for name, path in ensure_models(args.models, args.cache_dir).items():
        print(f"{name}: {path} {sorted(os.listdir(path))}")


if __name__ == "__main__":
    main()
