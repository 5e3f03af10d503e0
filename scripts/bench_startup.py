"""Start-up as a user meets it: `jaxllm generate` (the README's run command) to its output, and
`jaxllm serve` to `/health` 200, cold and warm, on the default model.

    python scripts/bench_startup.py [--reps 2] [--drop-page-cache] [--jaxllm jaxllm]

cold: empty kernel and executable caches (a temporary $JAXLLM_KERNEL_DIR and
$JAXLLM_CACHE_DIR), and with --drop-page-cache (root only) the OS page cache dropped first, as
on a fresh machine. warm: the same caches again, as filled by the cold run before it. Each rep
runs cold generate, warm generate, cold serve, warm serve, in that order (alternating, so a
slow minute hits all four), and prints every run's wall time with jaxllm's own start-up line;
then the median of each. Servers listen on 127.0.0.1 and are stopped by this script.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

PROMPT = ["--prompt", "The capital of France is", "--max-tokens", "32", "--temperature", "0"]
_READY = re.compile(r"Engine ready in .*")


def _env(cache: str) -> dict:
    return {**os.environ, "JAXLLM_KERNEL_DIR": os.path.join(cache, "kernels"),
            "JAXLLM_CACHE_DIR": os.path.join(cache, "xla")}


def _drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _generate(jaxllm: str, cache: str) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run([jaxllm, "generate", *PROMPT], env=_env(cache), capture_output=True,
                       text=True, timeout=900)
    wall = time.perf_counter() - t
    if r.returncode != 0 or "Paris" not in r.stdout:
        raise SystemExit(f"generate failed:\n{r.stdout}\n{r.stderr[-3000:]}")
    return wall, _ready_line(r.stderr)


def _serve(jaxllm: str, cache: str) -> tuple[float, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile(mode="w+")
    t = time.perf_counter()
    proc = subprocess.Popen([jaxllm, "serve", "--host", "127.0.0.1", "--port", str(port)],
                            env=_env(cache), stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise SystemExit(f"serve exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.perf_counter() - t > 900:
                    raise SystemExit("serve: no /health 200 within 900 s")
                time.sleep(0.1)
        wall = time.perf_counter() - t
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.seek(0)
    return wall, _ready_line(log.read())


def _ready_line(stderr: str) -> str:
    found = _READY.findall(stderr)
    return found[-1] if found else "(no start-up line)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--drop-page-cache", action="store_true",
                    help="drop the OS page cache before each cold run (root only)")
    ap.add_argument("--jaxllm", default=shutil.which("jaxllm") or "jaxllm",
                    help="the jaxllm command to time (e.g. a fresh venv's bin/jaxllm)")
    args = ap.parse_args()
    times: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for command, run in (("generate", _generate), ("serve", _serve)):
            with tempfile.TemporaryDirectory() as cache:
                for state in ("cold", "warm"):
                    if state == "cold" and args.drop_page_cache:
                        _drop_page_cache()
                    wall, line = run(args.jaxllm, cache)
                    times.setdefault(f"{command} {state}", []).append(wall)
                    print(f"rep {rep} {command:8s} {state}: {wall:6.1f} s   {line}", flush=True)
    print("\nmedian wall time (s):")
    for name, values in times.items():
        print(f"  {name:14s} {statistics.median(values):6.1f}   (runs: "
              f"{', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    sys.exit(main())
