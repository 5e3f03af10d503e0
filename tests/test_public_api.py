"""The public names: every one in `jaxllm.__all__` imports (lazily, without JAX for the host
types), every type the README and docs construct is among them, and BeamSearchParams has vLLM's
two import paths."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

import jaxllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def documented_names() -> set[str]:
    """Classes the docs call (`BeamSearchParams(beam_width=4)`) or import from jaxllm."""
    names = set()
    for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        with open(path) as f:
            text = f.read()
        names.update(re.findall(r"\b([A-Z]\w*)\(", text))
        for imported in re.findall(r"from jaxllm import ([\w, ]+)", text):
            names.update(n.strip() for n in imported.split(","))
    return names


def test_the_docs_name_the_types_users_need():
    """The scan finds what the README shows (so the next test cannot pass on an empty set)."""
    assert {"LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams"} <= \
        documented_names()


def test_every_documented_type_is_exported():
    missing = documented_names() - set(jaxllm.__all__)
    assert not missing, f"named in README.md/docs but not exported from jaxllm: {missing}"


@pytest.mark.parametrize("name", jaxllm.__all__)
def test_every_exported_name_imports(name):
    obj = getattr(jaxllm, name)
    assert isinstance(obj, type) and obj.__name__ in (name, "StructuredOutputsParams")


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchThing"):
        jaxllm.NoSuchThing  # noqa: B018


def test_beam_search_params_has_vllms_import_paths():
    from jaxllm import BeamSearchParams
    from jaxllm.entrypoints.beam_search import BeamSearchParams as used_by_the_search
    from jaxllm.sampling_params import BeamSearchParams as from_module

    assert BeamSearchParams is from_module is used_by_the_search
    assert BeamSearchParams(beam_width=4, max_tokens=32).beam_width == 4
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=32)


def test_import_jaxllm_and_its_host_types_stay_jax_free():
    code = ("import sys, jaxllm\n"
            "from jaxllm import SamplingParams, BeamSearchParams, StructuredOutputsParams\n"
            "print('jax' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]
