"""Imports run one way: serving -> entrypoints -> deploy -> engine -> worker -> models ->
layers -> kernels, with the host types (config, sampling params, sequences, outputs) below them
all.

Every import statement of every module (function-level ones too) is parsed with `ast`; an
import of a module in a higher layer fails the test, naming both.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxllm", "serving", "pallas_kernels")

# Longest matching prefix wins. A module may import its own layer and any below it.
LAYERS = {
    "serving": 8,              # the OpenAI server and the `jaxllm` command (serving/cli)
    "jaxllm": 7,               # the package itself re-exports LLM
    "jaxllm.entrypoints": 7,
    "jaxllm.benchmarks": 7,
    "jaxllm.deploy": 6,        # topology: data-parallel replicas, other nodes, follower hosts
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
    "jaxllm.engine_config": 0,      # the resolved, typed engine config (EngineArgs builds it)
    "jaxllm.json_object": 0,        # host types: no JAX, importable from anywhere
    "jaxllm.sampling_params": 0,
    "jaxllm.logits_processor": 0,  # the custom logits processors' interface (no JAX)
    "jaxllm.pooling_params": 0,
    "jaxllm.sequence": 0,
    "jaxllm.outputs": 0,
    "jaxllm.structured_output": 0,  # request constraints and the grammar engine (no JAX)
    "jaxllm.spec_decode.config": 0,
    "jaxllm.lora": 0,               # the LoRA request type (no JAX)  # --speculative-config, read by EngineArgs (no JAX)
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


# The modules that may import EngineArgs, the user's flags (their submodules too; and the
# package, which re-exports it). Everything else takes the typed parts of the EngineConfig it
# builds (jaxllm/engine_config.py).
ENGINE_ARGS_READERS = ("jaxllm.config", "jaxllm.engine", "jaxllm.deploy", "jaxllm.entrypoints")


def may_read_engine_args(module: str) -> bool:
    return module == "jaxllm" or any(module == r or module.startswith(r + ".")
                                     for r in ENGINE_ARGS_READERS)


def imports_engine_args(path: str) -> bool:
    """Whether the module imports EngineArgs (from any module, function-level imports too)
    or reaches it as an attribute (`jaxllm.config.EngineArgs`)."""
    tree = ast.parse(open(path).read(), path)
    return any(isinstance(node, ast.ImportFrom) and any(a.name == "EngineArgs"
                                                        for a in node.names)
               or isinstance(node, ast.Attribute) and node.attr == "EngineArgs"
               for node in ast.walk(tree))


def test_engine_args_stay_above_the_engine():
    """Below the engine (worker, models, layers, loader, spec_decode, parallel, tokenizer,
    structured_output, engine_config, ...) nothing imports EngineArgs."""
    found = [module for module, path in modules() if module.split(".")[0] == "jaxllm"
             and not may_read_engine_args(module) and imports_engine_args(path)]
    assert not found, f"these modules import EngineArgs; give them EngineConfig parts: {found}"


def test_the_check_sees_an_engine_args_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from jaxllm.config import ConfigError, EngineArgs\n")
    assert imports_engine_args(str(src))
    src.write_text("import jaxllm.config\nx = jaxllm.config.EngineArgs\n")
    assert imports_engine_args(str(src))
    src.write_text("from jaxllm.config import ConfigError\n")
    assert not imports_engine_args(str(src))
    assert not may_read_engine_args("jaxllm.engine_config")
    assert may_read_engine_args("jaxllm.engine.startup") and may_read_engine_args("jaxllm")


def graph():
    """Module-level import graph: module -> the modules of this repository it imports.

    `from X import Y` counts as an import of `X.Y` when that is a module, else of `X`;
    a package's `__init__` is the package itself. Function-level imports count too: a
    circle hidden inside a function is still a circle (the order of first use decides
    whether it breaks, not the code).
    """
    known = dict(modules())
    edges: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        tree = ast.parse(open(path).read(), path)
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            for target in targets:
                # `import a.b.c` names a.b.c; an unknown name falls back to its package.
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target:
                    edges[module].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan) with more than one module, or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def path_within(edges, component):
    """One circle through the component's first module, for the failure message."""
    members = set(component)
    start = component[0]
    trail, seen = [start], {start}

    def walk(v):
        for w in sorted(edges[v] & members):
            if w == start:
                return True
            if w not in seen:
                seen.add(w)
                trail.append(w)
                if walk(w):
                    return True
                trail.pop()
        return False

    walk(start)
    return " -> ".join(trail + [start])


def test_no_import_circles():
    edges = graph()
    found = cycles(edges)
    assert not found, "import circles:\n" + "\n".join(
        f"{c}: {path_within(edges, c)}" for c in found)


def test_the_check_sees_a_circle():
    """The cycle finder finds a hidden (function-level) circle and a self-import."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    edges = graph()
    assert "jaxllm.engine.scheduler" in edges["jaxllm.engine.engine"]
