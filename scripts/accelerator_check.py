"""One command for the first minutes on a GPU or TPU: what works there, how fast, and how far
from the hardware's limits (issue 42; docs/accelerators.md has the roofline model and the runs).

    PYTHONPATH=. python scripts/accelerator_check.py [--out DIR] [--dry-run] [--budget-s 420]
                                                     [--phases kernels,e2e] [--commit SHA]

Phases, in order (scripts/accelerator_phases.py, accelerator_gdn.py, accelerator_roofline.py,
accelerator_models.py, accelerator_archs.py):
  env       devices, versions, memory, which optional pieces import
  kernels   the Pallas ragged paged-attention kernel compiled for real against the pure-JAX
            reference on random ragged batches (decode / prefill / mixed, f32 / bf16 / fp8
            cache, page sizes, GQA ratios, sliding window, soft cap): max error, NaN
  gdn       the Pallas gated DeltaNet kernels (chunked and recurrent) against the reference:
            chunk boundaries, continuing and fresh states, decays near 0 and 1; error, time
  quant     int8 / int4 / fp8 `QuantizedWeight`s through the backend's `project` against a
            float64 numpy product
  roofline  the device's copy / read bandwidth and bf16 matmul rate, measured now; decode
            attention and the step's projections timed against them
  models    a tiny random model of each architecture against transformers on the same device
            (float32, highest matmul precision): greedy tokens equal
  archs     this wave's mechanisms (MLA, sinks, chunked attention, gated DeltaNet) as tiny
            models through the offline LLM: greedy tokens and logprobs against transformers
  e2e_hf    a Llama-3.2-1B-shaped random bf16 checkpoint built with transformers; its
            `generate` (256 x 128 -> 128, and batch-1 decode) as the peer
  e2e       jaxllm's offline LLM on that checkpoint: the same workloads, start-up split into
            load / compile (per program) / warm-up, against transformers and the roofline

Each phase runs in a process of its own with a share of --budget-s (time a phase leaves is
handed on): a phase past its share stops between cases and is recorded as "timed out", one
that hangs is killed, and the run goes on. DIR/report.json is rewritten after every phase, so a
killed run leaves what it had; DIR/summary.txt holds the end table and DIR/check.log every
phase's output (three files: the device tool brings back at most eight).

--dry-run (implied when jax's backend is cpu) runs every phase at toy sizes: on cpu with the
Pallas kernels interpreted, which CI runs (tests/test_accelerator_check.py) so the script cannot
rot; on an accelerator compiled for real, a smoke run of about a minute.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCHEMA = "jaxllm-accelerator-check/1"
# (phase, share of the budget). Shares are of the time still left when the phase starts, so
# what a quick phase leaves goes to the later ones, the end-to-end run most of all.
PHASES = (("env", 0.02), ("kernels", 0.18), ("gdn", 0.04), ("quant", 0.04), ("roofline", 0.14),
          ("models", 0.13), ("archs", 0.08), ("e2e_hf", 0.11), ("e2e", 0.26))
# A phase past its deadline gets this long to write its partial results before it is killed.
GRACE_S = 20.0
# Phases that run torch on the device: jax must not take 75 % of its memory up front there.
TORCH_PHASES = ("e2e_hf",)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: str, data: dict) -> None:
    """Atomically: a kill mid-write must not leave a truncated report."""
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


class Recorder:
    """A phase's results, written to its file after every change (the parent reads whatever is
    there when the phase ends, killed or not)."""

    def __init__(self, path: str, deadline: float):
        self.path, self.deadline = path, deadline
        self.data = {"status": "running", "result": {}, "checks": []}
        self.flush()

    def flush(self) -> None:
        write_json(self.path, self.data)

    def put(self, key: str, value) -> None:
        self.data["result"][key] = value
        self.flush()

    def append(self, key: str, value) -> None:
        self.data["result"].setdefault(key, []).append(value)
        self.flush()

    def check(self, name: str, passed: bool, **detail) -> bool:
        self.data["checks"].append({"name": name, "passed": bool(passed), **detail})
        self.flush()
        return bool(passed)

    def left(self) -> float:
        return self.deadline - time.time()

    def out_of_time(self, need_s: float = 0.0) -> bool:
        """True (and the phase marked timed out) when less than need_s is left."""
        if self.left() > need_s:
            return False
        self.data["timed_out"] = True
        self.flush()
        return True

    def skip(self, reason: str) -> None:
        self.data["skipped"] = reason
        self.flush()


# --- a phase, in its own process ----------------------------------------------------------------

def phase_function(prefix: str, phase: str):
    import accelerator_archs
    import accelerator_gdn
    import accelerator_models
    import accelerator_phases
    import accelerator_roofline

    for mod in (accelerator_phases, accelerator_roofline, accelerator_models, accelerator_archs,
                accelerator_gdn):
        if hasattr(mod, f"{prefix}_{phase}"):
            return getattr(mod, f"{prefix}_{phase}")
    raise LookupError(f"no {prefix}_{phase}")


def run_phase(args) -> int:
    from accelerator_phases import Context

    rec = Recorder(args.phase_file, args.deadline)
    ctx = Context(toy=args.toy, report=read_json(args.report), workdir=args.workdir)
    fn = phase_function("phase", args.run_phase)
    try:
        fn(rec, ctx)
    except BaseException as e:  # recorded for the report; the parent decides what follows
        rec.data["error"] = f"{type(e).__name__}: {e}"
        rec.data["traceback"] = traceback.format_exc()[-4000:]
        traceback.print_exc()
    d = rec.data
    if d.get("error"):
        d["status"] = "error"
    elif d.get("skipped"):
        d["status"] = "skipped"
    elif not all(c["passed"] for c in d["checks"]):
        d["status"] = "failed"
    elif d.get("timed_out"):
        d["status"] = "timed out"
    else:
        d["status"] = "passed"
    rec.flush()
    return 0


# --- the driver ----------------------------------------------------------------------------------

def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "jaxllm",
                                "pallas_kernels"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    sha = out.stdout.strip()
    return (sha + ("+dirty" if dirty.stdout.strip() else "")) if sha else None


def _source_fingerprint() -> str | None:
    """Identifies the code where there is no git (the device tool sends a bare copy)."""
    try:
        sys.path.insert(0, ROOT)
        from jaxllm.worker.executable_cache import source_fingerprint
        return source_fingerprint()[:16]
    except Exception as e:  # a broken import is env's to report, not this header's
        return f"unavailable ({type(e).__name__})"


def _backend_is_cpu() -> bool:
    """Asked in a child: jax in this process would hold the accelerator the phases need."""
    r = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                       capture_output=True, text=True, timeout=300, env=_child_env(None))
    return r.stdout.strip().splitlines()[-1:] == ["cpu"] if r.returncode == 0 else True


def _child_env(phase: str | None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, HERE, env.get("PYTHONPATH")]))
    if phase in TORCH_PHASES:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def _spawn(phase: str, budget: float, args, report_path: str, workdir: str, log) -> dict:
    phase_file = os.path.join(workdir, f"phase-{phase}.json")
    deadline = time.time() + budget
    cmd = [sys.executable, os.path.abspath(__file__), "--run-phase", phase,
           "--phase-file", phase_file, "--report", report_path, "--workdir", workdir,
           "--deadline", repr(deadline)] + (["--toy"] if args.toy else [])
    log.write(f"\n===== {phase} ({budget:.0f} s) {_now()}\n")
    log.flush()
    t = time.time()
    # A process group of its own, so that a hung phase is killed with whatever it started;
    # not a session of its own, which would outlive a kill of the whole command (the device
    # tool's) and keep the accelerator's memory from a rerun.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=_child_env(phase), process_group=0)
    killed, stopped = False, None
    try:
        rc = proc.wait(timeout=budget + GRACE_S)
    except subprocess.TimeoutExpired:
        rc, killed = None, True
    except (SystemExit, KeyboardInterrupt) as e:  # SIGTERM (see main) or Ctrl-C
        rc, stopped = None, e
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    data = read_json(phase_file) or {"result": {}, "checks": []}
    if stopped is not None:
        data["status"] = "interrupted"
        data["error"] = "the check was stopped during this phase"
    elif killed:
        data["status"] = "timed out"
        data["error"] = f"killed after {budget + GRACE_S:.0f} s (budget {budget:.0f} s)"
    elif data.get("status") in (None, "running"):
        data["status"] = "error"
        data["error"] = f"the phase process exited with {rc} before it finished"
    data.update(seconds=round(time.time() - t, 1), budget_s=round(budget, 1))
    return data, stopped is not None


def summary_rows(report: dict) -> list[list[str]]:
    rows = []
    for name, _ in PHASES:
        p = report["phases"].get(name)
        if p is None:
            continue
        try:
            lines = phase_function("summarize", name)(p["result"]) if p.get("result") else []
        except Exception as e:  # a partial result may lack what a summary reads
            lines = [f"(no summary: {type(e).__name__}: {e})"]
        failed = [c["name"] for c in p.get("checks", []) if not c["passed"]]
        if failed:
            lines.append("FAILED: " + ", ".join(failed[:6]) + (" ..." if len(failed) > 6 else ""))
        for key in ("skipped", "error"):
            if p.get(key):
                lines.append(f"{key}: {str(p[key])[:160]}")
        lines = lines or [""]
        rows.append([name, p["status"], f"{p.get('seconds', 0):.0f}s", lines[0]])
        rows += [["", "", "", line] for line in lines[1:]]
    return rows


def format_table(report: dict) -> str:
    rows = [["phase", "status", "time", "figures"]] + summary_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    head = (f"jaxllm accelerator check: {report.get('device', '?')}, commit "
            f"{report.get('commit') or '?'} ({report.get('source_fingerprint')}), "
            f"{'toy sizes' if report['toy'] else 'full sizes'}")
    lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3]
                      for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join("tmp", "accelerator-check"),
                    help="report folder (default: under tmp/, which git ignores)")
    ap.add_argument("--dry-run", action="store_true",
                    help="toy sizes (implied on a cpu backend, where kernels are interpreted)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="wall time for all phases (each gets a share)")
    ap.add_argument("--phases", default=",".join(p for p, _ in PHASES),
                    help="comma-separated subset, in any order (run in the fixed order)")
    ap.add_argument("--commit", default=None, help="the commit, where the copy has no git")
    # internal: one phase in its own process
    ap.add_argument("--run-phase", help=argparse.SUPPRESS)
    ap.add_argument("--phase-file", help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--toy", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path[:0] = [ROOT, HERE]
    if args.run_phase:
        return run_phase(args)

    # A terminated driver unwinds (its phase killed, its report kept) instead of vanishing.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    chosen = [p for p in args.phases.split(",") if p]
    unknown = set(chosen) - {p for p, _ in PHASES}
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}; known: {[p for p, _ in PHASES]}")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    args.toy = args.dry_run or _backend_is_cpu()
    report_path = os.path.join(args.out, "report.json")
    report = {"schema": SCHEMA, "started": _now(), "argv": sys.argv[1:],
              "commit": args.commit or _git_commit(), "source_fingerprint": _source_fingerprint(),
              "dry_run": args.dry_run, "toy": args.toy, "budget_s": args.budget_s,
              "python": sys.version.split()[0], "phases": {}}
    write_json(report_path, report)
    workdir = tempfile.mkdtemp(prefix="jaxllm-accel-")
    plan = [(p, share) for p, share in PHASES if p in chosen]
    try:
        with open(os.path.join(args.out, "check.log"), "w") as log:
            for i, (phase, share) in enumerate(plan):
                left = args.budget_s - (time.time() - t0)
                budget = max(left, 0.0) * share / sum(s for _, s in plan[i:])
                print(f"[{time.time() - t0:6.1f}s] {phase}: budget {budget:.0f} s", flush=True)
                stopped = False
                if budget < 1.0:
                    report["phases"][phase] = {"status": "timed out", "result": {}, "checks": [],
                                               "error": "no budget left", "seconds": 0.0}
                else:
                    report["phases"][phase], stopped = _spawn(phase, budget, args, report_path,
                                                              workdir, log)
                if phase == "env":
                    report["device"] = report["phases"]["env"].get("result", {}).get("device")
                print(f"[{time.time() - t0:6.1f}s] {phase}: {report['phases'][phase]['status']}",
                      flush=True)
                write_json(report_path, report)
                if stopped:
                    break
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["finished"] = _now()
    report["seconds"] = round(time.time() - t0, 1)
    report["passed"] = all(p["status"] == "passed" for p in report["phases"].values())
    table = format_table(report)
    report["summary"] = table.splitlines()
    write_json(report_path, report)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(table + "\n")
    print(table, flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
