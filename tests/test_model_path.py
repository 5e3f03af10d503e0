"""A model given as a path that does not exist is reported as a missing file or folder, not as
the Hugging Face hub's repo-id validation error; hub names still go to the hub."""

from __future__ import annotations

import os

import pytest

from jaxllm.config import ConfigError, EngineArgs
from jaxllm.loader import hf
from jaxllm.loader.default_model import check_local_path, looks_like_path


@pytest.mark.parametrize("model", ["/tmp/nope", "./no/such/model", "../model", "~/models/x",
                                   "a/b/c", "models/x.gguf", "x.gguf", "."])
def test_path_spellings(model):
    assert looks_like_path(model)


@pytest.mark.parametrize("model", ["gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct",
                                   "meta-llama/Llama-3.1-8B"])
def test_hub_names_are_not_paths(model):
    assert not looks_like_path(model)


def test_a_partly_existing_path_is_a_path(tmp_path, monkeypatch):
    """`models/llama` next to a local `models/` folder means that folder, not a hub org."""
    monkeypatch.chdir(tmp_path)
    assert not looks_like_path("models/llama")
    (tmp_path / "models").mkdir()
    assert looks_like_path("models/llama")


@pytest.mark.parametrize("model", ["./no/such/model", "/tmp/jaxllm-no-such-model",
                                   "~/jaxllm-no-such-model", "no/such.gguf"])
def test_missing_path_is_named(model):
    with pytest.raises(ConfigError, match=f"^no such file or folder: {model} "):
        check_local_path(model)


def test_existing_path_and_hub_name_pass(tmp_path, monkeypatch):
    check_local_path(str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    check_local_path("~/m")
    check_local_path("org/name")  # the hub decides


def test_download_refuses_a_missing_path_before_asking_the_hub(monkeypatch):
    import huggingface_hub

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked about a local path")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    with pytest.raises(ConfigError, match="^no such file or folder: ./no/such/model"):
        hf.download(EngineArgs(model="./no/such/model").create_engine_config().load)


def test_llm_with_a_missing_path():
    from jaxllm import LLM

    path = os.path.join("/tmp", "jaxllm-no-such-model-dir")
    with pytest.raises(ConfigError, match=f"^no such file or folder: {path} "):
        LLM(path)
