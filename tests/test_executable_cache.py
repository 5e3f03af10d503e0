"""The executable cache across processes (jaxllm/worker/executable_cache.py).

Each start is a fresh process (this file's __main__), as a restarted server is: it builds an
engine, waits for the background compiles, decodes greedily and prints a JSON report.
"""

import json
import os
import subprocess
import sys

import pytest

from test_engine import GREEDY, hf_greedy, mixed_prompts

PROMPTS = mixed_prompts(6, seed=5)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(path: str, cache_dir: str, jax_cache_dir: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["JAXLLM_CACHE_DIR"] = cache_dir
    # This checkout's code, not whichever jaxllm is installed (the script's folder is tests/).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    if jax_cache_dir:  # JAX's own persistent cache, storing every program
        env.update(JAX_COMPILATION_CACHE_DIR=jax_cache_dir,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    proc = subprocess.run([sys.executable, __file__, path], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _files(d) -> list:
    d = d / "jaxllm-executables"
    return sorted(d.iterdir()) if d.exists() else []


@pytest.mark.slow  # four cold/warm engine processes (~2 min); the key test below stays fast
def test_warm_start_loads_programs_and_decodes_the_same(tiny_llama, tmp_path):
    """Cold: every program compiled and saved. A start whose programs come from JAX's
    persistent cache saves none of them (such executables serialize incomplete). Warm: every
    program loaded without tracing, the same greedy tokens as transformers, and a damaged
    entry compiled and written again."""
    ours, jax_cache, other = tmp_path / "ours", tmp_path / "jax", tmp_path / "other"
    cold = _start(tiny_llama, str(ours), str(jax_cache))
    assert cold["programs_from_cache"] == 0
    assert len(_files(ours)) == cold["programs"] > 10
    expected = hf_greedy(tiny_llama, PROMPTS, GREEDY.max_tokens)
    assert cold["tokens"] == expected

    from_jax = _start(tiny_llama, str(other), str(jax_cache))
    assert from_jax["programs_from_cache"] == 0 and _files(other) == []
    assert from_jax["tokens"] == expected

    damaged = _files(ours)[0]
    damaged.write_bytes(b"not an executable")
    warm = _start(tiny_llama, str(ours))
    assert warm["programs_from_cache"] == warm["programs"] - 1
    assert warm["tokens"] == expected and warm["recompiles"] == 0
    assert damaged.read_bytes() != b"not an executable"


def test_key_follows_the_model_config_not_just_shapes(make_tiny_checkpoint, tiny_llama, load,
                                                      tmp_path):
    """Two models with the same shapes but another rms_norm_eps get different keys; the same
    model loaded again gets the same key."""
    from flax import nnx

    from jaxllm.worker.compile_manager import ProgramKey
    from jaxllm.worker.executable_cache import ExecutableCache

    def key(path):
        model, _, mesh = load(path)
        graphdef, state = nnx.split(model)
        cache = ExecutableCache(str(tmp_path), mesh.devices.flat, context=repr(graphdef))
        return cache.key(ProgramKey("forward", 16, False), (state,))

    base = key(tiny_llama)
    assert key(tiny_llama) == base
    assert key(make_tiny_checkpoint("llama", rms_norm_eps=1e-3)) != base


def _child(path: str) -> dict:
    os.environ["JAXLLM_FAIL_ON_RECOMPILE"] = "1"
    from test_engine import small_llm, token_ids

    llm = small_llm(path, max_num_seqs=2, max_num_batched_tokens=16)  # few programs
    runner = llm.llm_engine.runner
    runner.wait_for_background_compiles(load_cached=True)  # the damaged one too
    tokens = token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                    use_tqdm=False))
    cm = runner.compile_manager
    return {"programs": len(cm.programs()), "recompiles": cm.num_recompiles,
            "programs_from_cache": cm.programs_from_cache, "tokens": tokens}


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))


_RECOMPILE = """
import jax, jax.numpy as jnp
from jaxllm.worker.executable_cache import compile_lowered
f = jax.jit(lambda x: jnp.tanh(x) @ x.T)
x = jnp.ones((8, 8))
print([compile_lowered(f.lower(x))[1] for _ in range(3)])
"""


def test_a_program_from_jax_cache_is_never_reported_compiled_here(tmp_path):
    """Lowering the same jitted function again gets JAX's in-memory executable, with no
    cache-hit event: if JAX's persistent cache supplied it, it is still not "compiled here"
    (saving it would store an executable without its kernels)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))

    def run():
        proc = subprocess.run([sys.executable, "-c", _RECOMPILE], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip().splitlines()[-1]

    assert run() == "[True, True, True]"  # cold: compiled here, then the same executable
    assert run() == "[False, False, False]"  # every lowering: what JAX's cache loaded


def test_only_the_engines_thread_loads_from_the_cache(tmp_path):
    """Deferred programs the cache holds are loaded by the step that first runs them (none at
    start: a warm start deserializes nothing it does not use), on-demand ones by the caller;
    the compile threads only compile (and save). Loading in a compile thread while the
    engine's thread ran steps crashed the process."""
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.worker.compile_manager import CompileManager, ProgramKey
    from jaxllm.worker.executable_cache import ExecutableCache

    cache = ExecutableCache(str(tmp_path), jax.devices()[:1], context="test")
    loads = []
    get = cache.get
    cache.get = lambda key: (loads.append(threading.current_thread()), get(key))[1]
    c = float(np.random.default_rng().random())  # a new program: JAX's own cache cannot
    f = jax.jit(lambda x: x * 2 + c)              # supply it (it would not be saved then)
    key = lambda n: ProgramKey("forward", n)  # noqa: E731
    args = lambda n: (jnp.ones(n),)  # noqa: E731

    cold = CompileManager(executable_cache=cache)
    for n in (1, 2, 3):
        cold.defer(key(n), f, args(n))
    cold.start_background()
    cold.wait_for_background_compiles()
    assert len(list(tmp_path.iterdir())) == 3 and cold.programs_from_cache == 0

    loads.clear()
    warm = CompileManager(executable_cache=cache)
    for n in (1, 2, 3, 4):
        warm.defer(key(n), f, args(n))
    warm.start_background()
    assert {key(1), key(2), key(3)} <= set(warm.programs())  # before any compile thread ran
    warm.wait_for_background_compiles()
    assert warm.programs_from_cache == 3 and key(4) in warm.programs()
    assert len(list(tmp_path.iterdir())) == 4  # the compiled one saved
    assert loads == []  # nothing deserialized before a step needs it
    assert np.allclose(warm.run(key(2), f, *args(2)), 2 + c)
    assert np.allclose(warm.run(key(2), f, *args(2)), 2 + c)
    assert len(loads) == 1 and warm.num_recompiles == 0  # loaded once, on first use

    damaged = ExecutableCache(str(tmp_path), jax.devices()[:1], context="test")
    with open(damaged.path(damaged.key(key(3), args(3))), "wb") as file:
        file.write(b"not an executable")
    again = CompileManager(executable_cache=damaged)
    again.defer(key(3), f, args(3))
    again.start_background()
    assert again.programs_from_cache == 1
    assert np.allclose(again.run(key(3), f, *args(3)), 2 + c)  # compiled instead, and saved
    assert again.programs_from_cache == 0 and again.num_recompiles == 0
    assert ExecutableCache(str(tmp_path), jax.devices()[:1], context="test").get(
        damaged.key(key(3), args(3))) is not None

    on_demand = CompileManager(executable_cache=cache)
    assert on_demand.ready(key(4), f, lambda: args(4))  # loaded now, by the caller
    assert not on_demand.ready(key(5), f, lambda: args(5))  # compiling in the thread
    on_demand.wait_for_background_compiles()
    assert on_demand.ready(key(5), f, lambda: args(5))
    assert loads and all(t is threading.main_thread() for t in loads)
    assert np.allclose(on_demand.run(key(5), f, *args(5)), 2 + c)


def test_with_jax_cache_on_a_compile_waits_for_the_lowering_lock(tmp_path):
    """A compile may load from JAX's persistent cache (when a user turns it on):
    it then waits for `mlir_lock`, which the engine's thread holds while it lowers. A load
    racing a lowering in `compile_now`'s compiler threads crashed the process."""
    import threading

    import jax
    import numpy as np

    from jaxllm.worker.executable_cache import compile_lowered, jax_cache_in_use, mlir_lock

    # JAX decides at a process's first compile whether it uses its cache: compiling first
    # keeps it off for the rest of the suite whatever the setting says below; the lock
    # follows the setting.
    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.float32(1)))
    saved = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        assert jax_cache_in_use()
        c = float(np.random.default_rng().random())
        lowered = jax.jit(lambda x: x * 3 + c).lower(np.ones(7, np.float32))
        done = threading.Event()
        thread = threading.Thread(target=lambda: (compile_lowered(lowered), done.set()))
        with mlir_lock:
            thread.start()
            assert not done.wait(1.0)  # held back while the lock is held
        assert done.wait(120)
        thread.join()
    finally:
        jax.config.update("jax_compilation_cache_dir", saved)
    assert not jax_cache_in_use()  # the suite's default: compiles run in parallel
