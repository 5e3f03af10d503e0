"""Config and tokenizer read from GGUF metadata without torch (`gguf_hf_config`,
`gguf_tokenizer`), checked against transformers' own GGUF reading (which needs torch, present in
the test environment) and against SentencePiece itself; and the default model started in a
process where torch cannot be imported, as the README's plain install runs it."""

import io
import json
import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
import sentencepiece as spm
from transformers import AutoConfig, AutoTokenizer

from jaxllm.config import EngineArgs
from jaxllm.loader.default_model import default_model_path
from jaxllm.loader.gguf import gguf_hf_config
from jaxllm.loader.gguf_tokenizer import gguf_tokenizer
from jaxllm.models.model_config import ModelConfig

TEXTS = [
    "The capital of France is",
    "  leading spaces, trailing   \n\n\tand tabs\t",
    "Numbers: 3.14159, 2024-11-25, 1,000,000 and x=12345;",
    "Unicode: naïve café, Ελληνικά, 日本語のテキスト, emoji 🙂👍🏽",
    "def f(x):\n    return x ** 2  # code\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'm we'll they've it's",
    "",
]


@pytest.fixture(scope="module")
def smollm2():
    from smollm2_oracle import hf_tokenizer

    return default_model_path(), hf_tokenizer()


def test_smollm2_tokenizer_equals_transformers(smollm2):
    path, ref = smollm2
    tok = gguf_tokenizer(path)
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == ref(text).input_ids, text
        assert tok.decode(ids) == ref.decode(ids) == text, text
        assert tok.decode(ids, skip_special_tokens=True) == \
            ref.decode(ids, skip_special_tokens=True), text
    assert tok.all_special_tokens == ref.all_special_tokens
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == \
        (ref.bos_token, ref.eos_token, ref.unk_token, ref.pad_token)
    assert tok.chat_template == ref.chat_template and len(tok) == len(ref) == 49152


def _model_config(hf_config) -> ModelConfig:
    return ModelConfig.from_hf(hf_config, EngineArgs(dtype="float32").create_engine_config().model)


def test_smollm2_config_gives_the_same_model_config(smollm2):
    path, _ = smollm2
    folder, name = os.path.split(path)
    ref = AutoConfig.from_pretrained(folder, gguf_file=name)
    ref.architectures = ["LlamaForCausalLM"]
    ref.rms_norm_eps = 1e-5  # GGUF's float32 rounding, which gguf_hf_config undoes
    # and its Q4_1 projections kept quantized (transformers dequantizes GGUF files)
    ref.quantization_config = {"quant_method": "gguf", "weight_type": "Q4_1"}
    assert _model_config(gguf_hf_config(path)) == _model_config(ref)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_config_of_each_architecture_equals_transformers(tmp_path, arch):
    """Metadata as llama.cpp writes it -> the same ModelConfig as transformers' reading."""
    tokens = [chr(c) for c in range(33, 127)]  # printable ASCII: a byte-level vocabulary
    path = str(tmp_path / f"{arch}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(7)
    w.add_context_length(256)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(4)
    w.add_value_length(4)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        w.add_sliding_window(64)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours = gguf_hf_config(path)
    ref = AutoConfig.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf")
    ref.architectures = ours.architectures
    ref.rms_norm_eps = 1e-6  # GGUF's float32 rounding, which gguf_hf_config undoes
    if arch == "qwen3":  # transformers skips qwen3's attention.key_length (defaults to 128)
        assert ref.head_dim == 128
        ref.head_dim = 4
    assert ours.head_dim == 4
    assert ours.model_type == ref.model_type
    assert _model_config(ours) == _model_config(ref)
    assert (ours.num_hidden_layers, ours.vocab_size, ours.tie_word_embeddings) == \
        (7, len(tokens), True)


def _spm_gguf(tmp_path, add_bos: bool):
    """A SentencePiece BPE model trained here, written as llama.cpp writes one (tokens, scores,
    token types, no merges)."""
    corpus = [t for t in TEXTS if t] * 3 + [
        "the quick brown fox jumps over the lazy dog", "hello world, hello there",
        "SentencePiece splits words into pieces by their scores"] * 5
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=buf,
                                   vocab_size=500, model_type="bpe", byte_fallback=True,
                                   character_coverage=1.0, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False)  # as Llama 2's model
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(3 if sp.is_control(i) else 2 if sp.is_unknown(i) else
                     6 if sp.is_byte(i) else 5 if sp.is_unused(i) else 1)
    path = str(tmp_path / "spm.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, sp


@pytest.mark.parametrize("add_bos", [True, False])
def test_sentencepiece_tokenizer_equals_sentencepiece(tmp_path, add_bos):
    path, sp = _spm_gguf(tmp_path, add_bos)
    tok = gguf_tokenizer(path)
    unseen = ["Zebras zigzag through jungles", "tabs\tand ünïcödé 🙂", " two  spaces"]
    for text in TEXTS + unseen:
        text = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
        expected = ([sp.bos_id()] if add_bos else []) + sp.encode(text)
        ids = tok(text).input_ids
        assert ids == expected, text
        assert tok.decode(ids, skip_special_tokens=True) == sp.decode(sp.encode(text)), text
    assert tok.bos_token == sp.id_to_piece(sp.bos_id())


_NO_TORCH = textwrap.dedent("""
    import importlib.machinery, json, sys

    class NoTorch(importlib.machinery.PathFinder):
        # The path finder, blind to torch: find_spec says absent, import raises.
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                return None
            return super().find_spec(name, path, target)

    sys.meta_path = [NoTorch if f is importlib.machinery.PathFinder else f
                     for f in sys.meta_path]
    try:
        import torch
    except ImportError:
        pass
    else:
        raise SystemExit("torch is still importable")

    from jaxllm import LLM, SamplingParams
    llm = LLM(sys.argv[1] or None, max_model_len=64, max_num_seqs=2, enforce_eager=True,
              kv_cache_memory_bytes=8 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}, "The capital of France is"], greedy)
    chat = llm.chat([{"role": "user", "content": "Hi"}], greedy)
    print(json.dumps({"ids": list(out[0].outputs[0].token_ids), "text": out[1].outputs[0].text,
                      "chat_prompt": chat[0].prompt, "torch": "torch" in sys.modules}))
""")


def _run_without_torch(tmp_path, model: str) -> dict:
    env = {**os.environ, "JAXLLM_CACHE_DIR": ""}
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH, model], capture_output=True,
                          text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["torch"] is False
    return report


def test_default_model_starts_without_torch(tmp_path):
    """The plain install has no torch: start-up from the GGUF (config, tokenizer, chat
    template, weights) must not import it."""
    report = _run_without_torch(tmp_path, "")
    assert report["text"].startswith(" Paris"), report
    assert report["chat_prompt"].endswith("<|im_start|>user\nHi<|im_end|>\n"
                                          "<|im_start|>assistant\n")


@pytest.mark.slow  # a cold process; the default model's no-torch start stays default
def test_hf_folder_starts_without_torch(tmp_path, tiny_llama):
    """The same for a safetensors folder (config.json, tokenizer files, generation config):
    the tokens equal transformers' greedy ones."""
    from test_engine import hf_greedy
    report = _run_without_torch(tmp_path, tiny_llama)
    assert report["ids"] == hf_greedy(tiny_llama, [[5, 6, 7]], 4)[0]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert report["chat_prompt"] == tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
