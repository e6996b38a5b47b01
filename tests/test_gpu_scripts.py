"""The GPU machine's scripts, checked on the CPU so that they work the first time someone runs them there.

``benchmarks/gpu_check.py --device cpu`` runs every speed case's code (each in its child process) on a tiny model,
and ``benchmarks/aoti_probe.py --device cpu`` compiles and loads CPU packages in its children: both must finish
with no failed case. They take minutes, so they run in the slow suite. ``benchmarks/paged_attention_gpu.py
--smoke`` times the kernel on tiny shapes through Triton's interpreter (seconds, in the default suite). The GPU
checks that are tests (``test_gpu_torch_backend.py``, ``test_gpu_paged_attention.py``) check themselves on the CPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, timeout: float, tmp: Path | None = None) -> list[dict]:
    """The script's JSON lines (``$OUT`` unset: nothing is written beside them); fails on a non-zero exit.

    With ``tmp``, the script's TMPDIR: it must leave no scratch folder of its own there (they hold GBs of engines)."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT.parent,  # not the source tree: children import the installed package
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if tmp is not None:
        assert scratch_left(tmp) == [], "the script left its scratch folders"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def scratch_left(tmp: Path) -> list[str]:
    """The scripts' own scratch folders in ``tmp`` (torch's compile cache beside them is not theirs)."""
    return sorted(p.name for p in tmp.glob("trtbuild-*"))


@pytest.mark.slow
def test_gpu_check_on_the_cpu(tmp_path):
    lines = run_script("gpu_check.py", "--device", "cpu", "--budget", "1500", timeout=1800, tmp=tmp_path)
    summary = lines[-1]
    assert summary["case"] == "summary" and summary["failed"] == [] and summary["skipped"] == []
    cases = {line["case"]: line for line in lines}
    assert cases["speed/engine_decode_b1/torch-compile"]["decode_b1_tok_s"] > 0
    assert cases["speed/quantized_decode_b1/int8_wo"]["row_products"] == "all"  # the CPU's default
    assert cases["speed/quantized_decode_b1_matmuls/int4_wo"]["row_products"] == "none"
    assert any(row.startswith("| decode b1 tok/s") for row in summary["table"])


@pytest.mark.slow
def test_gpu_session_on_the_cpu(tmp_path):
    """benchmarks/gpu_session.py, the one command of a GPU session: it installs the project into a fresh folder and
    runs the three scripts (their CPU modes here) from there, each line passed through and written to ``$OUT``."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_session.py"), "--device", "cpu", "--budget-s", "900"],
        capture_output=True, text=True, timeout=1200, cwd=ROOT.parent, env={**os.environ, "OUT": str(tmp_path)},
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    session = json.loads(proc.stdout.splitlines()[-1])
    assert session == json.loads((tmp_path / "gpu_session.json").read_text())
    steps = {s["step"]: s for s in session["steps"]}
    assert list(steps) == ["paged_attention", "gpu_check", "aoti_probe"]
    for step in steps.values():
        assert step["rc"] == 0 and step["failed"] == [] and step["wrong"] == [] and step["lines"] > 2, step
    assert steps["gpu_check"]["skipped"] == []  # the CPU's three cases fit its share of 900 s
    for name in ("paged_attention_gpu", "gpu_check", "aoti_probe"):
        assert (tmp_path / f"{name}.jsonl").read_text().count("\n") > 2
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert any(line.get("case") == "speed/engine_decode_b1/torch-compile" and line["ok"] for line in lines)
    assert {"system_gxx", "default/load"} <= set(lines[-2]["loaded_and_ran"])  # aoti_probe's summary


@pytest.mark.slow
def test_gpu_session_cuts_a_step_at_its_share(tmp_path):
    """A step still running at its share of the budget is killed with the processes it started (exit status 124
    in the summary), and the session still ends with its summary, leaving no scratch folder (the killed step's
    included)."""
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "OUT": str(tmp_path), "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_session.py"), "--device", "cpu", "--budget-s", "20",
         "--only", "aoti_probe"],
        capture_output=True, text=True, timeout=300, cwd=ROOT.parent, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (step,) = json.loads(proc.stdout.splitlines()[-1])["steps"]
    assert step["step"] == "aoti_probe" and step["rc"] == 124 and step["seconds"] < 25, step
    left = subprocess.run(["pgrep", "-f", "trtbuild-aoti-probe-"], capture_output=True, text=True, check=False)
    assert left.stdout.strip() == "", "a probe outlived its step"
    assert scratch_left(tmp_path / "tmp") == []


@pytest.mark.slow
def test_aoti_probe_cpu_mode(tmp_path):
    lines = run_script("aoti_probe.py", "--device", "cpu", "--jobs", "2", timeout=900, tmp=tmp_path)
    summary = lines[-1]
    assert summary["probe"] == "summary" and summary["failed"] == []
    assert {"default/load", "in_process", "cpu_package"} <= set(summary["loaded_and_ran"])
    environment = lines[0]
    assert environment["probe"] == "environment" and environment["torch"]


def test_gpu_check_only_runs_the_named_cases_in_that_order():
    """``gpu_check.py --only`` (what a short GPU session asks for): the named cases, in the order named, each once."""
    import runpy

    script = runpy.run_path(str(ROOT / "benchmarks" / "gpu_check.py"))
    names = list(script["cases"]())
    chosen = script["selected"](names, "speed/model,speed/quantized_decode_b1/,speed/model,speed/engine_decode_b1/")
    assert chosen == [
        "speed/model", "speed/quantized_decode_b1/int8_wo", "speed/quantized_decode_b1/int4_wo",
        "speed/engine_decode_b1/torch-compile", "speed/engine_decode_b1/aot-inductor",
    ]  # fmt: skip
    assert script["selected"](names, None) == names
    session = runpy.run_path(str(ROOT / "benchmarks" / "gpu_session.py"))
    for prefix in session["GPU_CHECK_ORDER"]:  # every case a GPU session asks for exists
        assert script["selected"](names, prefix), prefix


def test_gpu_check_skips_a_case_that_does_not_fit_and_runs_a_later_one_that_does(tmp_path):
    """With 100 s of budget, a case that first builds the 1B engine (~130 s on the H200) is skipped with what it
    needs, and the case after it (~60 s) still runs: a short GPU session gets every figure that fits."""
    only = "environment,speed/engine_decode_b1/torch-compile,speed/model"
    lines = run_script("gpu_check.py", "--device", "cpu", "--budget", "100", "--only", only, timeout=300, tmp=tmp_path)
    by_case = {line["case"]: line for line in lines}
    assert by_case["environment"]["ok"] and by_case["speed/model"]["ok"]
    skipped = by_case["speed/engine_decode_b1/torch-compile"]["skipped"]
    assert skipped.startswith("needs ~130s,") and skipped.endswith("s of the budget left"), skipped
    assert by_case["summary"]["skipped"] == ["speed/engine_decode_b1/torch-compile"]


def test_paged_attention_gpu_smoke_mode():
    """benchmarks/paged_attention_gpu.py runs on a GPU machine later: its code paths (timing against SDPA and a
    copy, the sweep, the supervisor and its worker process) run here on tiny CPU shapes through the interpreter."""
    *records, best, done = run_script("paged_attention_gpu.py", "--smoke", timeout=300)
    assert done["kind"] == "done" and best["kind"] == "sweep_best" and best["of"] == 2
    assert [r["case"] for r in records] == ["smoke-decode", "smoke-prefill", "smoke-sweep", "smoke-sweep-fused"]
    assert best["case"] == min(records[2:], key=lambda r: r["ms"])["case"]  # no CUDA graphs here: by events time
    assert not any("error" in r for r in records), records
    # every timed launch's output checked against the op's float32 torch body on the same inputs
    assert done["wrong"] == [] and all(r[key] < 1e-5 for r in records for key in r if key.endswith("max_err"))
    assert sum(key.endswith("max_err") for r in records for key in r) == 6
    timed = [r for r in records if r["kind"] in ("decode", "prefill")]
    assert all(r["ratio_vs_sdpa"] > 0 for r in timed)
    # three ways per kernel form: events, host wall, CUDA graph (None without CUDA)
    assert all(r["kernel_host_ms"] > 0 and r["kernel_graph_ms"] is None and r["sdpa_graph_ms"] is None for r in timed)


def test_paged_attention_gpu_crash_costs_one_case():
    """A case whose worker process dies (here a real SIGSEGV, ``--fault``) is one error line with the exit status
    and the fault's Python stack; a fresh worker runs the cases after it."""
    *records, _, done = run_script("paged_attention_gpu.py", "--smoke", "--fault", "smoke-prefill", timeout=300)
    assert done["kind"] == "done"
    by_case = {r["case"]: r for r in records}
    assert list(by_case) == ["smoke-decode", "smoke-prefill", "smoke-sweep", "smoke-sweep-fused"]
    crashed = by_case["smoke-prefill"]
    assert crashed["rc"] == -signal.SIGSEGV and "worker died" in crashed["error"], crashed
    assert any("Segmentation fault" in line or "Fatal Python error" in line for line in crashed["trace"]), crashed
    assert "error" not in by_case["smoke-decode"] and by_case["smoke-sweep"]["ms"] > 0


@pytest.mark.slow  # it waits out its 30 s timeout (the crash above covers the worker's restart in the default suite)
def test_paged_attention_gpu_hang_costs_one_case():
    """A case silent for ``--case-timeout`` seconds (a kernel that never returns) has its worker killed and is one
    error line; the cases after it still run."""
    args = ("--smoke", "--fault", "smoke-decode:hang", "--case-timeout", "30")
    *records, _, _ = run_script("paged_attention_gpu.py", *args, timeout=300)
    by_case = {r["case"]: r for r in records}
    assert list(by_case) == ["smoke-decode", "smoke-prefill", "smoke-sweep", "smoke-sweep-fused"]
    assert "timed out after 30s" in by_case["smoke-decode"]["error"], by_case["smoke-decode"]
    assert "error" not in by_case["smoke-prefill"] and "error" not in by_case["smoke-sweep"]


@pytest.mark.slow
def test_triton_registers_script(tmp_path):
    """benchmarks/triton_registers.py (the kernels' registers and spills on sm_90, no GPU) on SmolLM2's heads: every
    decode tiling of both forms, the two-kernel ones with their cache-write kernel, figures from ptxas."""
    out = tmp_path / "regs.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "triton_registers.py"), "--layout", "smollm2", "--kind", "decode",
         "--json", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT.parent, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 5 and {r["form"] for r in rows} == {"two-kernel", "fused"}
    for row in rows:
        assert 0 < row["attention"]["registers"] <= 255 and row["attention"]["smem"] > 0
        assert ("write" in row) == (row["form"] == "two-kernel")
