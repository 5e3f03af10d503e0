"""Tests talk to public interfaces (issue 43): no test reads, writes or patches a private member
(`x._name`) of what it tests. A test tied to a private member breaks on every refactor and
passes on code no caller can reach; the behaviour it checks gets a public seam instead.

Every tests/*.py is parsed and these are flagged:
- an attribute `x._name` (one leading underscore, or a mangled `__name`; dunders are fine),
  unless `x` is `self` or `cls` inside a class the test file defines (a test helper's own);
- `setattr`/`getattr`/`hasattr`/`delattr`, monkeypatch's `.setattr`/`.delattr`, or mock's
  `patch`/`patch.object`, naming a private attribute in a string, or a private component in
  a dotted "module.name" string;
- an import of a private name or module. Imports from other test modules are exempt (shared
  test helpers: `_hf_model` is the tests' own), as are the entries of ALLOWED.

ALLOWED is small and each entry says why; an entry that no longer matches fails too, so the
list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
PATCHERS = {"setattr", "getattr", "hasattr", "delattr", "patch"}  # builtins, monkeypatch, mock

# (test file, private name) -> why a public interface cannot do
ALLOWED = {
    ("test_bench_cli.py", "_actions"): "argparse has no public API listing a parser's actions",
    ("test_bench_cli.py", "_SubParsersAction"): "argparse's subcommand action type is not public",
    ("test_bench_cli.py", "_get_help_string"): "argparse renders one action's help only here",
    ("test_bench_cli.py", "_HelpAction"): "argparse's -h action type is not public",
    ("test_vllm_flags.py", "_option_string_actions"):
        "argparse has no public flag -> action lookup",
    ("test_pallas_attention.py", "jax._src.pallas.mosaic.interpret"):
        "the Pallas TPU interpreter's race detector has no public handle (jax 0.10)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted_private(text: str) -> bool:
    return "." in text and any(_private(part) for part in text.split("."))


def _is_test_module(module: str) -> bool:
    return (TESTS / f"{module.split('.')[0]}.py").exists()


class _Finder(ast.NodeVisitor):
    def __init__(self):
        self.found: list[tuple[int, str, str]] = []  # (line, private name, what)
        self._scopes: list[bool] = []  # per enclosing class or function: within a class?

    def visit_ClassDef(self, node):
        self._scopes.append(True)
        self.generic_visit(node)
        self._scopes.pop()

    def visit_FunctionDef(self, node):
        self._scopes.append(bool(self._scopes) and self._scopes[-1])  # a method, or in one
        self.generic_visit(node)
        self._scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self.visit_FunctionDef(node)

    def visit_Attribute(self, node):
        own = (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
               and self._scopes and self._scopes[-1])
        if _private(node.attr) and not own:
            self.found.append((node.lineno, node.attr, ast.unparse(node)))
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        strings = [a.value for a in node.args[:2]
                   if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if name in PATCHERS or (name == "object" and ast.unparse(f).endswith("patch.object")):
            for text in strings:
                if _private(text) or _dotted_private(text):
                    self.found.append((node.lineno, text, ast.unparse(node)[:80]))
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        module = node.module or ""
        if node.level == 0 and not _is_test_module(module):
            if any(_private(p) for p in module.split(".")):
                self.found.append((node.lineno, module, f"from {module} import ..."))
            for alias in node.names:
                if _private(alias.name):
                    self.found.append((node.lineno, alias.name, f"from {module} import "
                                       f"{alias.name}"))

    def visit_Import(self, node):
        for alias in node.names:
            if any(_private(p) for p in alias.name.split(".")) and not _is_test_module(
                    alias.name):
                self.found.append((node.lineno, alias.name, f"import {alias.name}"))


def private_uses(source: str) -> list[tuple[int, str, str]]:
    """(line, private name, the expression) of each private member the source reaches."""
    finder = _Finder()
    finder.visit(ast.parse(source))
    return finder.found


def test_no_test_reaches_a_private_member():
    bad, used = [], set()
    for path in sorted(TESTS.glob("*.py")):
        for line, name, what in private_uses(path.read_text()):
            if (path.name, name) in ALLOWED:
                used.add((path.name, name))
            else:
                bad.append(f"{path.name}:{line}: {what}")
    assert not bad, "tests reach private members; give them a public seam:\n" + "\n".join(bad)
    assert not set(ALLOWED) - used, f"stale ALLOWED entries: {sorted(set(ALLOWED) - used)}"


@pytest.mark.parametrize("source", [
    "kv._hash = lambda p, t: 0",
    "assert len(r._owner) == 8",
    "engine._replica_of[rid]",
    "sched._preempt = preempt",
    "leader._closing, f._stopped = True, True",
    "def f(self):\n    return self._x",           # `self` outside any class: not its own
    "class A:\n    pass\ndef f(self):\n    return self._x",
    "class A:\n    def f(self, other):\n        return other._x",
    "monkeypatch.setattr(step_channel, '_kv_client', lambda: store)",
    "monkeypatch.setattr('jaxllm.parallel.step_channel._kv_client', f)",
    "getattr(obj, '_free')",
    "mock.patch('jaxllm.engine.scheduler.Scheduler._preempt')",
    "mock.patch.object(sched, '_preempt')",
    "from jaxllm.layers.experts import _stable_order",
    "from jaxllm._private import thing",
    "import jaxllm._private",
    "x.__mangled",
])
def test_the_check_catches(source):
    assert private_uses(source)


@pytest.mark.parametrize("source", [
    "class A:\n    def f(self):\n        self._x = 1\n        return self._x",
    "class A:\n    @classmethod\n    def f(cls):\n        return cls._x",
    "class A:\n    def f(self):\n        return [lambda: self._x]",
    "x.__class__.__name__",
    "monkeypatch.setattr(step_channel, 'HEARTBEAT_SECONDS', 0.05)",
    "from test_models import _hf_model",
    "_chunks.append(1)",
    "def _helper():\n    pass",
    "logging.getLogger('jax._src.xla_bridge')",  # a logger's name: a string, not an access
])
def test_the_check_allows(source):
    assert not private_uses(source)
