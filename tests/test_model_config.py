"""`ModelConfig.from_hf`: the HF config read as transformers reads it (RoPE spellings, Gemma 3's
local and global RoPE, dtypes), with the engine's overrides (max_model_len, sliding window,
hf_overrides) and the refusals that name what is wrong."""

from types import SimpleNamespace

import pytest

from jaxllm.config import ConfigError, EngineArgs
from jaxllm.models.model_config import ALLOW_LONG_ENV, ModelConfig
from jaxllm.models.rope import RopeSpec
from test_models import ROPE_SCALING, _llama_hf


def options(**engine_args):
    """The model options of these engine arguments (what ModelConfig.from_hf applies)."""
    return EngineArgs(**engine_args).create_engine_config().model


def test_config_reads_legacy_rope_spelling():
    new = ModelConfig.from_hf(_llama_hf(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                         "rope_theta": 5e5}))
    legacy = SimpleNamespace(**{k: v for k, v in _llama_hf().to_dict().items()
                                if k != "rope_parameters"},
                             rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert ModelConfig.from_hf(legacy) == new
    assert new.rope[0] == RopeSpec("linear", 5e5, 2.0)


def test_config_gemma3_local_and_global_rope():
    """Gemma 3's sliding layers use rope_local_base_freq and never the global scaling; its
    attn_logit_softcapping is ignored (as transformers and vLLM do)."""
    from transformers import Gemma3TextConfig

    hf = Gemma3TextConfig(vocab_size=512, hidden_size=48, intermediate_size=96,
                          num_hidden_layers=6, num_attention_heads=3, num_key_value_heads=1,
                          head_dim=16, sliding_window=8, architectures=["Gemma3ForCausalLM"],
                          attn_logit_softcapping=50.0,
                          rope_parameters={
                              "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                 "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    legacy = SimpleNamespace(**{k: v for k, v in hf.to_dict().items() if k != "rope_parameters"},
                             rope_theta=1e6, rope_local_base_freq=1e4,
                             rope_scaling={"rope_type": "linear", "factor": 8.0})
    legacy.sliding_window = 8  # to_dict() stores Gemma's window in its own convention
    for c in (hf, legacy):
        cfg = ModelConfig.from_hf(c)
        assert cfg.sliding_window == (8, 8, 8, 8, 8, 0)  # every 6th layer is global
        assert [r.theta for r in cfg.rope] == [1e4] * 5 + [1e6]
        assert [r.rope_type for r in cfg.rope] == ["default"] * 5 + ["linear"]
        assert (cfg.norm_offset, cfg.sandwich_norms, cfg.qk_norm) == (1.0, True, True)
        assert cfg.attn_logit_softcap is None  # ignored by Gemma 3, as in transformers
        assert cfg.embed_scale == pytest.approx(48 ** 0.5)


def test_config_dtype_auto_reads_a_legacy_torch_dtype_without_the_alias():
    """--dtype auto takes the checkpoint's dtype, also from a config.json that spells it
    `torch_dtype` (transformers 5 reads it into `dtype`), and never touches transformers'
    deprecated `torch_dtype` alias, which logged a warning in a new user's first run (the
    GGUF default model's config names no dtype)."""
    from transformers import LlamaConfig

    class NoAlias(LlamaConfig):
        @property
        def torch_dtype(self):
            raise AssertionError("read the deprecated torch_dtype alias")

    legacy = {k: v for k, v in _llama_hf().to_dict().items() if k != "dtype"}
    for key, value, expected in (("torch_dtype", "float16", "float16"),
                                 ("dtype", "bfloat16", "bfloat16"),
                                 ("torch_dtype", "float32", "bfloat16"),  # vLLM's auto rule
                                 (None, None, "bfloat16")):  # no dtype: float32, then the rule
        c = NoAlias.from_dict({**legacy, **({key: value} if key else {})})
        assert ModelConfig.from_hf(c, options(dtype="auto")).dtype == expected, key


def test_config_engine_overrides():
    opts = options(rope_theta=1234.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                   hf_overrides={"num_hidden_layers": 1})
    cfg = ModelConfig.from_hf(_llama_hf(), opts)
    assert cfg.rope == (RopeSpec("linear", 1234.0, 4.0),)
    assert cfg.num_layers == 1
    assert cfg.max_model_len == 256 * 4  # linear scaling stretches the context, as in vLLM


def test_config_max_model_len(monkeypatch):
    assert ModelConfig.from_hf(_llama_hf()).max_model_len == 256
    assert ModelConfig.from_hf(_llama_hf(), options(max_model_len="128")).max_model_len == 128
    with pytest.raises(ConfigError, match="--max-model-len=512.*max_position_embeddings=256"):
        ModelConfig.from_hf(_llama_hf(), options(max_model_len=512))
    monkeypatch.setenv(ALLOW_LONG_ENV, "1")
    assert ModelConfig.from_hf(_llama_hf(), options(max_model_len=512)).max_model_len == 512
    yarn = ROPE_SCALING["yarn"]
    assert ModelConfig.from_hf(_llama_hf(rope_parameters=yarn)).max_model_len == 64 * 4


def test_config_disable_sliding_window():
    from transformers import MistralConfig
    hf = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, sliding_window=100,
                       max_position_embeddings=256, architectures=["MistralForCausalLM"])
    assert ModelConfig.from_hf(hf).sliding_window == (100, 100)
    cfg = ModelConfig.from_hf(hf, options(disable_sliding_window=True))
    assert (cfg.sliding_window, cfg.max_model_len) == ((0, 0), 100)


@pytest.mark.parametrize("ckpt,model_type,requested,want", [
    ("float32", "llama", "auto", "bfloat16"),
    ("bfloat16", "llama", "auto", "bfloat16"),
    ("float16", "llama", "auto", "float16"),
    ("float16", "gemma3_text", "auto", "bfloat16"),
    ("bfloat16", "llama", "float32", "float32"),
    ("bfloat16", "llama", "half", "float16"),
    ("float32", "llama", "float", "float32"),
])
def test_config_dtype(ckpt, model_type, requested, want):
    hf = _llama_hf(dtype=ckpt)
    hf.model_type = model_type
    assert ModelConfig.from_hf(hf, options(dtype=requested)).dtype == want


def test_config_rejects_float16_gemma_and_unknown_architecture():
    hf = _llama_hf()
    hf.model_type = "gemma3_text"
    with pytest.raises(ConfigError, match="--dtype=float16"):
        ModelConfig.from_hf(hf, options(dtype="float16"))
    with pytest.raises(ConfigError, match="not supported; supported: LlamaForCausalLM, "
                                          "MistralForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_hf(_llama_hf(architectures=["GPT2LMHeadModel"]))
