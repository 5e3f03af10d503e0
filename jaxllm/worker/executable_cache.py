"""Compiled step programs on disk, keyed before tracing, for a fast warm start.

JAX's persistent compilation cache keys on the lowered program, so even a warm start traces
and lowers every bucket first (seconds of a small model's start-up). This cache keys on what the
programs are made of instead: the source of jaxllm and its kernels, the jax/jaxlib versions,
the devices, the XLA flags, the module's structure (model config included) and the shapes,
dtypes and shardings of the arguments; a hit loads the executable without tracing.

jaxllm leaves JAX's persistent cache to the user (JAX_COMPILATION_CACHE_DIR): an executable
that XLA:CPU loaded from there serializes without its kernels (it then fails at run time with
"Function ... not found"), so a program JAX's cache supplied is not saved here.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

logger = logging.getLogger("jaxllm")

_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # recorded in the compiling thread
_compiling = threading.local()
# One load or lowering at a time: two threads deserializing XLA:CPU executables at once (the
# step's thread and the background compiles) crashed the process (a segfault in
# persistent_load), and so did one deserializing while another lowered (a segfault in MLIR's
# op builders). Both only build MLIR/HLO on the host; XLA's compiles still run in parallel.
mlir_lock = threading.Lock()


def _on_jax_event(event: str, **_) -> None:
    if event == _JAX_CACHE_HIT:
        _compiling.from_jax_cache = True


jax.monitoring.register_event_listener(_on_jax_event)


def jax_cache_in_use() -> bool:
    """Whether JAX's persistent compilation cache is on (JAX_COMPILATION_CACHE_DIR): any
    compile may then be a load from it."""
    return bool(jax.config.jax_compilation_cache_dir) and jax.config.jax_enable_compilation_cache


def compile_lowered(lowered):
    """(lowered.compile(), whether XLA compiled it in this process rather than JAX's cache
    loading it, now or for an earlier lowering of the same program).

    With JAX's persistent cache on, the compile holds `mlir_lock`: it may deserialize an
    executable from that cache, which crashed the process (a segfault in JAX's
    `get_executable_and_time`) while a compiler thread of `compile_now` loaded another one
    as the engine's thread lowered the next program. JAX gives no way to take the lock for
    the load alone, so such compiles run one at a time; without JAX's cache (jaxllm's own
    executable cache loads under the lock) they run in parallel."""
    _compiling.from_jax_cache = False
    if jax_cache_in_use():
        with mlir_lock:
            exe = lowered.compile()
    else:
        exe = lowered.compile()
    # Lowering the same jitted function again returns the same lowering, which keeps its
    # executable and hands it back with no cache-hit event: the mark stays on the lowering.
    lowering = getattr(lowered, "_lowering", lowered)
    if _compiling.from_jax_cache:
        lowering._jaxllm_from_jax_cache = True
    return exe, not getattr(lowering, "_jaxllm_from_jax_cache", False)


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SOURCE_DIRS = ("jaxllm", "pallas_kernels")
_SOURCE_SUFFIXES = (".py", ".cc", ".h")


@functools.lru_cache(maxsize=None)
def source_fingerprint() -> str:
    """Hash of every source file that can shape a program (Python, C++ kernels)."""
    h = hashlib.sha256()
    for top in _SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(_ROOT, top)):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(_SOURCE_SUFFIXES):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, _ROOT).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def _cpu_kernels() -> str:
    """The native CPU kernels a program may call: built and registered as FFI targets before
    a cached executable naming them is loaded (a program traced without them differs)."""
    if jax.default_backend() != "cpu":
        return ""
    from pallas_kernels.activation import kernel_cpu as activation_cpu
    from pallas_kernels.matmul import kernel_cpu as matmul_cpu
    from pallas_kernels.ragged_paged_attention import kernel_cpu as attention_cpu
    return (f"matmul={matmul_cpu.available()} activation={activation_cpu.available()} "
            f"attention={attention_cpu.available()}")


def _signature(args) -> str:
    """Tree structure plus shape, dtype and sharding of every leaf."""
    leaves, tree = jax.tree.flatten(args)
    parts = [str(tree)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        parts.append(f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:"
                     f"{sharding!r}")
    return "|".join(parts)


class ExecutableCache:
    """key(name, args) -> get(key): a loaded executable or None; put(key, compiled) after a
    compile. Errors only log: the cache never stops a start-up.

    devices: the mesh's devices, in its order (an executable runs on the devices it was
    compiled for). context: what else shapes the programs (the module's structure).
    """

    def __init__(self, directory: str, devices, context: str):
        self.directory = directory
        self.devices = list(devices)
        self._context = "\n".join((
            source_fingerprint(), jax.__version__, jaxlib.__version__, jax.default_backend(),
            repr([(d.id, d.platform, d.device_kind) for d in self.devices]), _cpu_kernels(),
            os.environ.get("XLA_FLAGS", ""), repr(jax.config.jax_enable_x64),
            repr(jax.config.jax_default_matmul_precision), context))

    def key(self, name: Any, args) -> str:
        h = hashlib.sha256(self._context.encode())
        h.update(repr(name).encode())
        h.update(_signature(args).encode())
        return h.hexdigest()[:32]

    def path(self, key: str) -> str:
        """The file that holds (or would hold) the executable saved under key."""
        return os.path.join(self.directory, f"{key}.exe")

    def holds(self, key: str) -> bool:
        """Whether an executable is saved under key (it may still fail to load: `get`)."""
        return os.path.exists(self.path(key))

    def get(self, key: str):
        path = self.path(key)
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            with mlir_lock:
                return serialize_executable.deserialize_and_load(
                    payload, in_tree, out_tree, backend=self.devices[0].client,
                    execution_devices=self.devices)
        except Exception as e:  # a truncated or incompatible file: compile instead
            logger.warning("ignoring cached executable %s: %s", path, e)
            return None

    def put(self, key: str, compiled) -> None:
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            os.makedirs(self.directory, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as f:
                f.write(blob)
            os.replace(f.name, self.path(key))  # atomic: readers see a whole file or none
        except Exception as e:
            logger.warning("could not cache executable %s: %s", key, e)

