"""scripts/accelerator_check.py, run as CI can run it: --dry-run on this CPU (toy sizes, the
Pallas kernels interpreted), so the script meant for a GPU or TPU cannot rot unnoticed.

The dry run takes about 90 s on the 2-core machine (each phase is a process of its own, with
its own imports; about 60 s when the suite's jax compilation cache is warm): the slow set.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "accelerator_check.py")
PHASES = ["env", "kernels", "gdn", "quant", "roofline", "models", "archs", "e2e_hf", "e2e"]


def run_check(out, *args, timeout=300):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(out), *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    with open(out / "report.json") as f:
        return proc, json.load(f)


@pytest.mark.slow
def test_dry_run_passes_every_phase(tmp_path):
    # The default 420 s budget is an accelerator's; interpreted on 2 cpu cores every phase's
    # toy run needs more (the archs phase starts five engines).
    proc, report = run_check(tmp_path, "--budget-s", "1500", timeout=1700)
    log = (tmp_path / "check.log").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + log[-6000:]
    assert report["schema"] == "jaxllm-accelerator-check/1" and report["toy"] and report["passed"]
    assert list(report["phases"]) == PHASES
    for name, phase in report["phases"].items():
        assert phase["status"] == "passed", (name, phase.get("error"), phase.get("checks"))
        assert phase["checks"] and all(c["passed"] for c in phase["checks"]), name
    table = (tmp_path / "summary.txt").read_text()
    assert all(f"\n{name} " in table for name in PHASES)
    assert sorted(os.listdir(tmp_path)) == ["check.log", "report.json", "summary.txt"]
    r = {name: p["result"] for name, p in report["phases"].items()}

    assert r["env"]["backend"] == "cpu" and r["env"]["versions"]["jax"]
    kernels = r["kernels"]
    assert kernels["interpret"] and kernels["variant"] == "gpu" and not kernels.get("not_run")
    assert {"decode", "prefill", "mixed"} <= {c["kind"] for c in kernels["cases"]}
    assert {"gpu", "tpu"} == {c["variant"] for c in kernels["cases"]}
    assert any(c["window"] and c["cap"] for c in kernels["cases"])
    assert any(c["cache"].startswith("float8") for c in kernels["cases"])
    for c in kernels["cases"]:  # cpu: f32 to 1e-5, bf16 to 2e-2, nothing leaked from padding
        assert c["nan"] == 0 and c["padding_zero"] and c["max_abs_err"] <= c["tol"], c

    gdn = r["gdn"]  # both forms, both dtypes, every case; errors against the reference
    assert gdn["interpret"] and not gdn.get("not_run") and len(gdn["cases"]) == 10
    assert {(c["form"], c["dtype"]) for c in gdn["cases"]} == {
        (f, d) for f in ("chunked", "recurrent") for d in ("float32", "bfloat16")}
    assert all(c["out_nan"] == c["state_nan"] == 0 and c["out_rel_err"] <= c["tol"]
               and c["state_rel_err"] <= c["tol"] for c in gdn["cases"]), gdn["cases"]

    assert len(r["quant"]["cases"]) == 16
    assert all(c["rel_err"] <= c["tol"] and c["nan"] == 0 for c in r["quant"]["cases"])

    roof = r["roofline"]
    assert roof["ceilings"]["read_gbs"] > 0 and roof["ceilings"]["bf16_tflops"] > 0
    assert all(a["pallas"]["us_per_layer"] > 0 and a["xla_reference"]["us_per_layer"] > 0
               for a in roof["decode_attention"])
    assert {p["weight"] for p in roof["projections"]} == {"bf16", "int8", "int4", "fp8"}
    assert roof["step_projections"] and all(s["of_roofline"] > 0 for s in roof["step_projections"])

    models = r["models"]["models"]
    from conftest import ARCHS  # every test architecture, each compared with transformers
    assert [m["arch"] for m in models] == list(ARCHS) and not r["models"].get("not_run")
    assert all(m["tokens_equal"] and m["max_logit_err"] < 1e-3 for m in models), models
    archs = r["archs"]["archs"]  # this wave's mechanisms, each through the offline LLM
    assert [a["arch"] for a in archs] == ["deepseek_v3", "gpt_oss", "llama4", "qwen3_next", "gemma4"]
    assert all(a["tokens_equal"] and a["max_logprob_err"] < 1e-3 for a in archs), archs

    hf, e2e = r["e2e_hf"], r["e2e"]
    assert hf["throughput"]["output_tokens_per_s"] > 0 and hf["batch1"]
    assert e2e["throughput"]["output_tokens_per_s"] > 0 and e2e["batch1"]
    assert {"load", "compile", "warm_up_s"} <= set(e2e["startup"])
    assert e2e["compiles"]["count"] > 0 and e2e["recompiles"] == 0
    assert e2e["roofline_bound"]["source"] == "measured"  # the roofline phase's ceilings
    assert 0 < e2e["of_roofline"]["throughput"] < 1 and e2e["vs_transformers"]["throughput"] > 0


def test_phases_out_of_time_are_recorded_and_the_run_goes_on(tmp_path):
    """A budget too small for anything: every phase is recorded as timed out (one never
    started, one stopped before its first case), and the report and table are still written."""
    proc, report = run_check(tmp_path, "--budget-s", "6", "--phases", "env,kernels,quant",
                             timeout=120)
    assert proc.returncode == 1
    assert list(report["phases"]) == ["env", "kernels", "quant"]
    assert {p["status"] for p in report["phases"].values()} == {"timed out"}, report["phases"]
    assert report["phases"]["kernels"]["result"]["not_run"]  # its cases, named
    assert not report["passed"]
    assert "timed out" in (tmp_path / "summary.txt").read_text()
