"""jaxllm.worker.host_memory: freed XLA:CPU buffers stay mapped for the next step.

Each case runs in a fresh interpreter (the settings are process-wide and cannot be undone)."""

import subprocess
import sys

PROBE = r"""
import ctypes, os, sys
from jaxllm.worker.host_memory import keep_freed_memory
applied = keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def faults():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt
size = 64 << 20  # above glibc's largest mmap threshold: mmapped, and unmapped on free, by default
for _ in range(2):  # the second round reuses what the first freed, if it was kept
    p = libc.malloc(size)
    before = faults()
    ctypes.memset(p, 1, size)
    touched = faults() - before
    libc.free(p)
print(applied, touched)
"""


def _probe(env_extra):
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    applied, touched = out.stdout.split()
    return applied == "True", int(touched)


def test_freed_buffers_are_reused_without_page_faults():
    applied, touched = _probe({})
    assert applied
    assert touched < 100, f"{touched} page faults re-touching a freed 64 MiB block"


def test_default_malloc_faults_again_so_the_probe_can_tell():
    # With the user's own MALLOC_* setting the engine leaves malloc alone: glibc then unmaps the
    # 64 MiB block on free and the second round faults every page in again.
    applied, touched = _probe({"MALLOC_ARENA_MAX": "2", "MALLOC_TOP_PAD_": "0"})
    assert not applied
    assert touched > 10000
