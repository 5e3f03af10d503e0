"""Paged decode attention for XLA:CPU: `kernel_cpu.cc`, built with the system C++ compiler on
first use (cached per source and machine) and called through the XLA FFI.

Decode steps only (one query per sequence, f32 cache, one device): the pure-JAX reference runs
prefill and everything else. `available()` says whether the kernel could be built here.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger("jaxllm")

TARGET = "jaxllm_paged_decode"
_SOURCE = os.path.join(os.path.dirname(__file__), "kernel_cpu.cc")


def _cache_dir() -> str:
    """$JAXLLM_KERNEL_DIR, else ~/.cache/jaxllm/kernels (apart from the XLA cache, which
    $JAXLLM_CACHE_DIR may move or disable)."""
    return (os.environ.get("JAXLLM_KERNEL_DIR")
            or os.path.join(os.path.expanduser("~"), ".cache", "jaxllm", "kernels"))


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return platform.processor()


@functools.lru_cache(maxsize=None)
def _build() -> Optional[str]:
    """Path of the built library, or None (with the reason logged) if it cannot be built."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        logger.warning("no C++ compiler: CPU decode attention falls back to the pure-JAX path")
        return None
    with open(_SOURCE, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src + _cpu_id().encode() + jax.__version__.encode()).hexdigest()[:16]
    out = os.path.join(_cache_dir(), f"paged_decode_{key}.so")
    if os.path.exists(out):
        return out
    os.makedirs(_cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
        tmp_out = os.path.join(tmp, "lib.so")
        cmd = [cxx, "-O3", "-march=native", "-ffast-math", "-fPIC", "-shared",
               "-std=c++17", f"-I{jax.ffi.include_dir()}", _SOURCE, "-o", tmp_out]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            logger.warning("building the CPU decode attention kernel failed (%s); falling back "
                           "to the pure-JAX path:\n%s", " ".join(cmd), res.stderr[-2000:])
            return None
        os.replace(tmp_out, out)  # atomic: concurrent builders all end with a whole file
    return out


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Build (once) and register the kernel; False if this machine cannot build it."""
    path = _build()
    if path is None:
        return False
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxllmPagedDecode),
                                platform="cpu")
    return True


def paged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer,
                           kv_lens: jax.Array, block_tables: jax.Array, num_seqs: jax.Array, *,
                           sm_scale: float, sliding_window=None,
                           soft_cap: Optional[float] = None) -> jax.Array:
    """Attention output [T, Hq, D] in q's dtype for a decode step (query row s = sequence s).

    Caches must be float32; q is computed in float32. sliding_window may be traced (per layer).
    """
    if not available():
        raise RuntimeError("the CPU decode attention kernel could not be built (see the log)")
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_cache, v_cache, jnp.asarray(layer, jnp.int32),
               kv_lens, block_tables, num_seqs, window,
               sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)
