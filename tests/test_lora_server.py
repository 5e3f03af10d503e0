"""Multi-LoRA serving, vLLM's interface: `--enable-lora --lora-modules name=path ...`, the
request's `model` choosing the adapter, /v1/models listing the adapters (root = path, parent =
base model), /v1/load_lora_adapter and /v1/unload_lora_adapter with
$VLLM_ALLOW_RUNTIME_LORA_UPDATING, and the `vllm:lora_requests_info` gauge.

First the parts without a model (the flag's parsing and start-up rules, the adapter registry,
the routes on fakes; the async engine's pass-through is in tests/test_lora_async_engine.py),
then one real `jaxllm serve` process on the tiny Llama with two random peft adapters. Its
greedy completions are compared with transformers + peft greedy on the same adapter (an oracle
independent of the engine: the token ids must be equal, and each adapter's must differ from
the base model's).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import openai
import pytest

from jaxllm.engine.stats import EngineStats
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import CompletionOutput, RequestOutput
from serving.cli.serve import parse_args
from serving.cli_args import LoRAModulePath, lora_modules
from serving.errors import APIError
from serving.lora_adapters import LoRAAdapters, runtime_updating_allowed
from server_process import API_KEY, ENGINE_FLAGS, ServerProcess, free_port

NAME = "tiny"


# --- --lora-modules --------------------------------------------------------------------------

def test_lora_modules_take_name_path_and_json_values():
    args = parse_args(["m", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b"}',
                       "--lora-modules",
                       '{"name": "c", "path": "/x/c", "base_model_name": "m"}'])
    assert args.lora_modules == [LoRAModulePath("a", "/x/a"), LoRAModulePath("b", "/x/b"),
                                 LoRAModulePath("c", "/x/c", "m")]
    assert parse_args(["m"]).lora_modules is None
    assert parse_args(["m", "--lora-modules", "a=/p=q"]).lora_modules == [
        LoRAModulePath("a", "/p=q")]


@pytest.mark.parametrize("value, says", [
    ("a", "expected name=path or a JSON object"),
    ("=/x", "expected name=path"),
    ('{"name": "a"}', "'path' must be a non-empty string"),
    ('{"name": "a", "path": "/x", "rank": 8}', "unknown field 'rank'"),
    ('["a", "/x"]', "expected name=path or a JSON object"),
    ('{"name": "a", "path": "/x", "base_model_name": 3}', "'base_model_name' must be a string"),
])
def test_bad_lora_modules_are_refused_naming_the_flag(value, says, capsys):
    with pytest.raises(SystemExit):
        parse_args(["m", "--lora-modules", value])
    err = capsys.readouterr().err
    assert "argument --lora-modules" in err and says in err


def test_lora_modules_from_a_config_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lora_modules:\n  - a=/x/a\n  - {name: b, path: /x/b, base_model_name: m}\n")
    assert parse_args(["m", "--config", str(cfg)]).lora_modules == [
        LoRAModulePath("a", "/x/a"), LoRAModulePath("b", "/x/b", "m")]


@pytest.mark.parametrize("argv, enable, says", [
    (["--lora-modules", "a=/x"], False, "--lora-modules requires --enable-lora"),
    (["--lora-modules", "m=/x"], True, "--lora-modules m: the name is a served model name"),
    (["--lora-modules", "a=/x", "a=/y"], True, "--lora-modules a: the name is given twice"),
    (["--lora-modules", '{"name": "a", "path": "/x", "base_model_name": "z"}'], True,
     "--lora-modules a: base_model_name 'z' is not a served model name (m)"),
])
def test_lora_modules_start_up_rules(argv, enable, says):
    with pytest.raises(ValueError, match="^" + re.escape(says)):
        lora_modules(parse_args(["m", *argv]), ["m"], enable)
    assert lora_modules(parse_args(["m"]), ["m"], False) == []


def test_runtime_updating_variable_reads_as_vllms():
    for value, on in (("True", True), ("1", True), ("true", True), ("0", False),
                      ("False", False), ("", False)):
        assert runtime_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}) is on
    assert runtime_updating_allowed({}) is False


# --- the adapter registry and the routes, on a fake engine -----------------------------------

class FakeLoRAEngine:
    """The async engine's LoRA calls and `generate` (one finished token), recording them;
    an adapter path containing 'bad' is refused as the engine refuses one."""

    def __init__(self):
        self.loras: dict[int, LoRARequest] = {}
        self.generated: list = []
        self.engine_args = SimpleNamespace(served_model_name=[NAME], model="/models/tiny",
                                           max_logprobs=20, max_num_seqs=4)
        self.model_config = SimpleNamespace(max_model_len=64, vocab_size=100)
        self.generation_defaults = {}
        self.eos_token_ids = frozenset()

    def get_tokenizer(self):
        return None

    def health(self, stall_after):
        return None

    def stats(self):
        return EngineStats()

    async def add_lora(self, request: LoRARequest) -> bool:
        if "bad" in request.lora_path:
            raise ValueError(f"{request.lora_path}/adapter_config.json: no such file")
        self.loras[request.lora_int_id] = request
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        return self.loras.pop(lora_int_id, None) is not None

    async def generate(self, prompt, params, request_id, priority=0, lora_request=None):
        self.generated.append((request_id, lora_request))
        yield RequestOutput(request_id, None, list(prompt), None,
                            [CompletionOutput(0, "", [7], None, None, "length")], True,
                            metrics={})


def test_adapters_get_ids_in_order_and_vllms_errors():
    async def run():
        engine, adapters = FakeLoRAEngine(), LoRAAdapters([NAME])
        await adapters.register(engine, [LoRAModulePath("a", "/x/a"),
                                         LoRAModulePath("b", "/x/b", NAME)])
        assert {i: (r.lora_name, r.lora_path, r.base_model_name)
                for i, r in engine.loras.items()} == {1: ("a", "/x/a", NAME),
                                                      2: ("b", "/x/b", NAME)}
        for name, path, status, says in (
                ("a", "/x/c", 400, "The lora adapter 'a' has already been loaded."),
                (NAME, "/x/c", 400, "is the name of a served model"),
                ("c", "/x/bad", 400, "Cannot load the lora adapter 'c' from '/x/bad': "
                                     "/x/bad/adapter_config.json: no such file"),
                ("", "/x/c", 400, "Both 'lora_name' and 'lora_path' must be provided.")):
            with pytest.raises(APIError) as e:
                await adapters.load(engine, name, path)
            assert e.value.status == status and says in e.value.message
        with pytest.raises(APIError) as e:
            await adapters.unload(engine, "zzz")
        assert e.value.status == 404 and e.value.message == (
            "The lora adapter 'zzz' cannot be found.")
        with pytest.raises(APIError, match="lora_int_id 5 is not the id"):
            await adapters.unload(engine, "a", 5)
        assert await adapters.unload(engine, "a", 1) == (
            "Success: LoRA adapter 'a' removed successfully.")
        assert await adapters.load(engine, "a", "/x/a2") == (
            "Success: LoRA adapter 'a' added successfully.")
        assert adapters.get("a").lora_int_id == 4  # ids are never reused (3: the bad one)
        with pytest.raises(ValueError, match=r"^--lora-modules c=/x/bad: Cannot load"):
            await adapters.register(engine, [LoRAModulePath("c", "/x/bad")])
    asyncio.run(run())


def _app(runtime_updating: bool, monkeypatch):
    from starlette.testclient import TestClient

    from serving.api_server import build_app
    from serving.state import ServingState

    monkeypatch.delenv("JAXLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    engine = FakeLoRAEngine()
    state = ServingState.from_engine(engine)
    state.lora.runtime_updating = runtime_updating
    asyncio.run(state.lora.register(engine, [LoRAModulePath("a", "/x/a")]))
    return TestClient(build_app(state, parse_args([]))), engine


def test_model_field_chooses_the_adapter(monkeypatch):
    client, engine = _app(False, monkeypatch)
    for model, adapter in ((NAME, None), (None, None), ("a", "a")):
        r = client.post("/v1/completions", json={"model": model, "prompt": [1, 2]})
        assert r.status_code == 200 and r.json()["model"] == (model or NAME)
        lora = engine.generated[-1][1]
        assert (lora and lora.lora_name) == adapter
    assert engine.generated[-1][1] == LoRARequest("a", 1, "/x/a", NAME)
    r = client.post("/v1/chat/completions", json={"model": "a", "messages": [
        {"role": "user", "content": "hi"}]})  # no tokenizer: refused, after the model check
    assert r.status_code == 400
    r = client.post("/v1/completions", json={"model": "nope", "prompt": [1]})
    assert r.status_code == 404 and r.json() == {"error": {
        "message": "The model `nope` does not exist.", "type": "NotFoundError",
        "param": "model", "code": 404}}
    r = client.post("/v1/embeddings", json={"model": "a", "input": [1]})
    assert r.status_code == 400 and "is a LoRA adapter" in r.json()["error"]["message"]
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        (NAME, "/models/tiny", None), ("a", "/x/a", NAME)]


def test_runtime_routes_are_refused_without_the_variable(monkeypatch):
    client, engine = _app(False, monkeypatch)
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/x/b"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a"}),
                       ("/v1/unload_lora_adapter", {})):
        r = client.post(path, json=body)
        assert r.status_code == 404, r.text
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in r.json()["error"]["message"]
    assert set(engine.loras) == {1}
    assert "/v1/load_lora_adapter" not in client.get("/openapi.json").json()["paths"]


def test_runtime_routes_with_the_variable(monkeypatch):
    client, engine = _app(True, monkeypatch)
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/x/b"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'b' added successfully.")
    assert r.headers["content-type"].startswith("text/plain")
    assert [c["id"] for c in client.get("/v1/models").json()["data"]] == [NAME, "a", "b"]
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/x/b"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    for body, param in (({"lora_name": "c", "lora_path": "/x", "load_inplace": True},
                         "load_inplace"),
                        ({"lora_name": "c", "lora_path": "/x", "extra": 1}, "extra"),
                        ({"lora_name": "c"}, "lora_path")):
        r = client.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'b' removed successfully.")
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 404 and r.json()["error"]["message"] == (
        "The lora adapter 'b' cannot be found.")
    assert client.post("/v1/completions", json={"model": "b", "prompt": [1]}).status_code == 404
    assert set(engine.loras) == {1}
    assert "/v1/load_lora_adapter" in client.get("/openapi.json").json()["paths"]


def test_lora_requests_info_gauge():
    from jaxllm.engine.stats import EngineStats, LoraStats
    from serving.metrics import EngineStatsCollector

    def info(lora):
        engine = SimpleNamespace(stats=lambda: EngineStats(lora=lora))
        return [f for f in EngineStatsCollector(engine, "m").collect()
                if f.name.endswith("lora_requests_info")]

    (family,) = [f for f in info(LoraStats(("a", "b", "a"), ("b",), 2))
                 if f.name.startswith("jaxllm:")]
    (sample,) = family.samples
    assert sample.labels == {"max_lora": "2", "running_lora_adapters": "a,b",
                             "waiting_lora_adapters": "b"}
    assert sample.value > 1.7e9  # a timestamp, as vLLM's
    assert info(None) == []


# --- the async engine passes adapters through its thread -------------------------------------

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """Two random peft adapters of the tiny Llama (non-zero B: init_lora_weights=False), each
    with transformers + peft's greedy token ids for PROMPT; and the base model's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok(PROMPT, return_tensors="pt").input_ids

    def greedy(model) -> list[int]:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        return out[0, ids.shape[1]:].tolist()

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    expected = {NAME: greedy(base)}
    paths = {}
    for seed, (name, targets) in enumerate((("sql", ["q_proj", "v_proj"]),
                                            ("chat", ["q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"]))):
        torch.manual_seed(seed + 1)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(
            tiny_llama, dtype=torch.float32), LoraConfig(
            r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
        expected[name] = greedy(model)
        paths[name] = str(tmp_path_factory.mktemp(f"lora-{name}"))
        model.save_pretrained(paths[name])
    return paths, expected


@pytest.fixture(scope="module")
def server(tiny_llama, adapters):
    paths, _ = adapters
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    old = os.environ.copy()
    os.environ.update(env)  # the server subprocess inherits it
    try:
        srv = ServerProcess(tiny_llama, *ENGINE_FLAGS, "--served-model-name", NAME,
                            "--api-key", API_KEY, "--enable-lora", "--max-loras", "2",
                            "--max-lora-rank", "8", "--lora-modules",
                            f"sql={paths['sql']}",
                            json.dumps({"name": "chat", "path": paths["chat"],
                                        "base_model_name": NAME}))
    finally:
        os.environ.clear()
        os.environ.update(old)
    yield srv
    srv.stop()


def _token_ids(client, model: str) -> list[int]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0.0, logprobs=0,
                                  extra_body={"ignore_eos": True,
                                              "return_tokens_as_token_ids": True})
    assert r.model == model
    return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]


@pytest.mark.slow  # the module's server (~40 s to start); test_lora.py checks peft offline
def test_each_adapter_generates_as_transformers_and_peft(client, adapters):
    _, expected = adapters
    got = {model: _token_ids(client, model) for model in (NAME, "sql", "chat")}
    assert got == expected
    assert got["sql"] != got[NAME] and got["chat"] != got[NAME]
    chat = client.chat.completions.create(model="chat", temperature=0.0, max_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.model == "chat"


@pytest.mark.slow  # the module's server (~40 s to start)
def test_models_lists_the_adapters(client, adapters, tiny_llama):
    paths, _ = adapters
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [NAME, "sql", "chat"]
    assert cards[NAME].root == tiny_llama and cards[NAME].parent is None
    for name in ("sql", "chat"):
        assert (cards[name].root, cards[name].parent) == (paths[name], NAME)


@pytest.mark.slow  # the module's server (~40 s to start)
def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert e.value.body["message"] == "The model `nope` does not exist."
    assert e.value.body["param"] == "model"


@pytest.mark.slow  # the module's server (~40 s to start)
def test_load_and_unload_at_run_time(server, client, http, adapters):
    paths, expected = adapters
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": paths["sql"]})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql2' added successfully.")
    assert _token_ids(client, "sql2") == expected["sql"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": paths["sql"]})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert r.status_code == 400 and "Cannot load the lora adapter 'x'" in r.text
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql2' removed successfully.")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql2", prompt=PROMPT, max_tokens=2)
    assert [m.id for m in client.models.list().data] == [NAME, "sql", "chat"]
    assert _token_ids(client, "sql") == expected["sql"]


@pytest.mark.slow  # the module's server (~40 s to start)
def test_lora_requests_info_metric(http):
    text = http.get("/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line


def test_lora_modules_without_enable_lora_fail_at_start_up(tiny_llama):
    cmd = [sys.executable, "-m", "serving.cli.main", "serve", tiny_llama, "--port",
           str(free_port()), "--host", "127.0.0.1", "--lora-modules", "a=/x"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "error: --lora-modules requires --enable-lora" in r.stderr


@pytest.mark.slow
def test_a_bad_adapter_fails_start_up_naming_it(tiny_llama, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(RuntimeError, match=r"--lora-modules broken="):
        ServerProcess(tiny_llama, *ENGINE_FLAGS, "--enable-lora", "--lora-modules",
                      f"broken={tmp_path}", timeout=300)
