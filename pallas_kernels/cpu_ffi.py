"""Native XLA:CPU kernels: C++ sources built with the system compiler on first use (cached per
source, machine and jax version) and registered as XLA FFI targets.

The kernels use XLA's own intra-op thread pool (`cpu_parallel.h`), so they share the cores
with XLA's dots instead of spinning a second pool against them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from typing import Optional

import jax

logger = logging.getLogger("jaxllm")

_HERE = os.path.dirname(os.path.abspath(__file__))
# Not -ffast-math: its reassociation lets the compiler sum the same terms in a different order
# in each inlined copy of a loop (a kernel's streaming and blocked paths, say), and batch
# invariance needs every element summed in one order whatever the path. The parts that keep
# results exact to the source are kept: no errno or traps, and a * b + c may fuse
# (deterministically, per expression; the matmul writes its FMAs out).
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast",
         "-fPIC", "-shared", "-std=c++17")


def flags() -> tuple[str, ...]:
    """FLAGS with -march from $JAXLLM_CPU_MARCH (default native), read at each build: a lower
    ISA (x86-64-v3: AVX2, x86-64-v2: SSE4.2) builds and measures the kernels' narrower paths on
    a machine that has wider ones."""
    march = os.environ.get("JAXLLM_CPU_MARCH") or "native"
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


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
def build(source: str) -> Optional[str]:
    """Path of the shared library built from `source` (a path), or None (the reason logged)."""
    name = "_".join((os.path.basename(os.path.dirname(source)),
                     os.path.splitext(os.path.basename(source))[0]))
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        logger.warning("no C++ compiler: %s falls back to the pure-JAX path", name)
        return None
    with open(source, "rb") as f:
        src = f.read()
    for header in _included(source):  # a header's change rebuilds what includes it
        with open(header, "rb") as f:
            src += f.read()
    used = flags()
    key = hashlib.sha256(src + " ".join(used).encode() + _cpu_id().encode()
                         + jax.__version__.encode()).hexdigest()[:16]
    out = os.path.join(_cache_dir(), f"{name}_{key}.so")
    if os.path.exists(out):
        return out
    os.makedirs(_cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
        tmp_out = os.path.join(tmp, "lib.so")
        cmd = [cxx, *used, f"-I{jax.ffi.include_dir()}", f"-I{_HERE}", source, "-o", tmp_out]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            logger.warning("building %s failed (%s); falling back to the pure-JAX path:\n%s",
                           name, " ".join(cmd), res.stderr[-2000:])
            return None
        os.replace(tmp_out, out)  # atomic: concurrent builders all end with a whole file
    return out


def _included(source: str) -> list[str]:
    """The headers `source` includes with quotes, and theirs, found as the compiler does (next
    to the including file, then in pallas_kernels/): one kernel may include another's core."""
    seen, todo = [], [source]
    while todo:
        current = todo.pop()
        with open(current, encoding="utf-8") as f:
            names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read(), re.M)
        here = os.path.dirname(current)
        for name in names:
            for d in (here, _HERE):
                path = os.path.normpath(os.path.join(d, name))
                if os.path.exists(path):
                    if path not in seen:
                        seen.append(path)
                        todo.append(path)
                    break
    return sorted(seen)


_locks: dict[str, threading.Lock] = {}


def register(source: str, targets: tuple[tuple[str, str], ...]) -> bool:
    """Build `source` and register each (FFI target name, handler symbol); False if it cannot
    be built here. Thread-safe: the loader builds the kernels in the background."""
    with _locks.setdefault(source, threading.Lock()):
        return _register(source, targets)


@functools.lru_cache(maxsize=None)
def _register(source: str, targets: tuple[tuple[str, str], ...]) -> bool:
    path = build(source)
    if path is None:
        return False
    lib = ctypes.cdll.LoadLibrary(path)
    for target, symbol in targets:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return True
