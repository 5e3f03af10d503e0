"""Imports run one way: serving -> entrypoints -> engine -> worker -> models -> layers ->
kernels, with the host types (config, sampling params, sequences, outputs) below them all.

Every import statement of every module (function-level ones too) is parsed with `ast`; an
import of a module in a higher layer fails the test, naming both.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxllm", "serving", "pallas_kernels")

# Longest matching prefix wins. A module may import its own layer and any below it.
LAYERS = {
    "serving": 7,              # the OpenAI server and the `jaxllm` command (serving/cli)
    "jaxllm": 6,               # the package itself re-exports LLM
    "jaxllm.entrypoints": 6,
    "jaxllm.benchmarks": 6,
    "jaxllm.spec_decode.draft_model": 5,  # drives a ModelRunner and KVCacheManager of its own
    "jaxllm.engine": 5,
    "jaxllm.worker": 4,
    "jaxllm.spec_decode": 4,   # speculative decoding: proposers, verification, counters
    "jaxllm.loader": 4,        # builds the model for the engine's start-up
    "jaxllm.tokenizer": 4,
    "jaxllm.models": 3,
    "jaxllm.layers": 2,
    "jaxllm.parallel": 1,
    "pallas_kernels": 1,
    "jaxllm.config": 0,
    "jaxllm.json_object": 0,        # host types: no JAX, importable from anywhere
    "jaxllm.sampling_params": 0,
    "jaxllm.pooling_params": 0,
    "jaxllm.sequence": 0,
    "jaxllm.outputs": 0,
    "jaxllm.structured_output": 0,  # request constraints and the grammar engine (no JAX)
    "jaxllm.spec_decode.config": 0,  # --speculative-config, read by EngineArgs (no JAX)
}
# (importer, imported) pairs allowed to go upward, each with its reason. Keep it empty.
ALLOWED: dict[tuple[str, str], str] = {}


def layer(module: str):
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        level = LAYERS.get(".".join(parts[:n]))
        if level is not None:
            return level
    return None


def modules():
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for name in sorted(files):
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, name), ROOT)[:-3]
                    module = rel.replace(os.sep, ".").removesuffix(".__init__")
                    yield module, os.path.join(dirpath, name)


def imported(path: str, module: str):
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base


def test_every_module_has_a_layer():
    missing = [m for m, _ in modules() if layer(m) is None]
    assert not missing, f"give these modules a layer in LAYERS: {missing}"


def test_imports_run_one_way():
    upward = []
    for module, path in modules():
        for target in imported(path, module):
            if target.split(".")[0] not in PACKAGES:
                continue
            if layer(target) > layer(module) and (module, target) not in ALLOWED:
                upward.append(f"{module} (layer {layer(module)}) imports {target} "
                              f"(layer {layer(target)})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The parser finds function-level and relative imports (the check can fail)."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from serving.api_server import run_server\n"
                   "from .sampler import sample\n")
    found = list(imported(str(src), "jaxllm.layers.m"))
    assert sorted(found) == ["jaxllm.layers.sampler", "serving.api_server"]
    assert layer("serving.api_server") > layer("jaxllm.layers.m")
