"""One command for a session on the GPU machine: install the project, then run the GPU scripts in one time budget.

A session is lent the GPU for about 15 minutes in all, machine start included, and one command may run at most 10.
This script is that command (from the repository root, no venv, no network; stdlib only until the install)::

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_session.py                 # ~9 minutes: --budget-s 540
    python3 benchmarks/gpu_session.py --device cpu --budget-s 900        # its CPU check (tests/test_gpu_scripts.py)

It installs the repository into a fresh folder (``pip install --no-deps --no-build-isolation --no-index
--target``; ``trtbuild.plugins`` maps to ``plugins/``, so the scripts run the installed copy, from another folder),
then runs these steps in order, each a process of its own whose JSON lines pass through (and go to ``$OUT`` as the
scripts write them), each cut at its share of the budget plus what earlier steps left unused:

- ``paged_attention`` (35%): ``paged_attention_gpu.py``, the kernel next to SDPA with each output checked (issue 35);
- ``gpu_check`` (45%): ``gpu_check.py --only`` the figures no run has produced yet, most needed first (issue 34):
  bf16 batch-1 decode (with the ceiling), the int8 / int4 weight-only engines, 64 requests and the TTFT, the
  one-row-product variants that settle the GPU's default, transformers' compiled static cache;
- ``aoti_probe`` (20%): ``aoti_probe.py --only`` the fix candidates for the AOTInductor load fault (2026-12-04).

``--only STEP,...`` runs some of them (the budget is shared among those). The last line is a ``session`` summary
(each step's exit status, seconds, lines, failed / wrong / skipped cases), also written to ``$OUT/gpu_session.json``.
On the CPU (``--device cpu``) the same steps run each script's CPU mode on tiny shapes: a check, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK_ORDER = [  # gpu_check.py cases, most needed first (prefixes; see its cases())
    "environment", "speed/model", "speed/weight_read_ceiling", "speed/engine_decode_b1/torch-compile",
    "speed/quantized_decode_b1/", "speed/engine_64x512x128_and_ttft", "speed/quantized_decode_b1_matmuls/",
    "speed/engine_decode_b1_row_products/", "speed/transformers_static_compiled", "speed/transformers_eager",
    "speed/llm_decode_b1", "speed/default_kv_pool",
]  # fmt: skip
CPU_GPU_CHECK_ORDER = ["environment", "speed/model", "speed/engine_decode_b1/torch-compile"]
AOTI_PROBES = "default/compile,system_gxx,preload_compiler_libstdcxx"  # the CPU check's
# On the GPU machine: not preload_compiler_libstdcxx, a no-op there (its g++'s libstdc++ is the one the process maps
# already, /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33: aoti_probe-2026-12-04-h200-run2.jsonl); the fix candidate
# first, the default (the known fault) as the control
GPU_AOTI_PROBES = "system_gxx,default/compile"


# Each step's script arguments for a device and the seconds it has: each script starts no case after its budget;
# one still running at the limit is killed with the step.
def paged_attention_args(device: str, limit_s: float) -> list[str]:
    """A case takes ~5-30 s on the H200 (a new launch configuration compiles)."""
    return ["--smoke"] if device == "cpu" else ["--budget-s", f"{max(limit_s - 30, 10):.0f}", "--case-timeout", "90"]


def gpu_check_args(device: str, limit_s: float) -> list[str]:
    """gpu_check starts a case only when its estimate fits the step's limit (a case building the 1B engine took
    108-122 s on the H200, one reusing it 43-63 s: ``gpu_check.Case.estimate_s``): one started later would be
    killed with the step, its line and gpu_check's summary lost, its seconds taken from the next step."""
    only = ",".join(CPU_GPU_CHECK_ORDER if device == "cpu" else GPU_CHECK_ORDER)
    return ["--device", device, "--only", only, "--budget", f"{max(limit_s - 10, 5):.0f}",
            "--case-timeout", f"{min(200.0, max(limit_s - 10, 30)):.0f}"]  # fmt: skip


def aoti_probe_args(device: str, limit_s: float) -> list[str]:
    """Probes compiling at once (84-97 s each on the H200, 2026-12-04); each child is cut before the step is, so a
    probe the share cannot finish still reports the stage it reached."""
    only = AOTI_PROBES if device == "cpu" else GPU_AOTI_PROBES
    return ["--device", device, "--only", only, "--jobs", "3", "--timeout", f"{max(limit_s - 30, 20):.0f}"]


@dataclass(frozen=True)
class Step:
    """One script of the session: its share of the budget and its arguments (``args(device, limit_s)``: so that it
    starts no work it cannot finish in ``limit_s`` seconds)."""

    name: str
    script: str
    share: float
    args: Callable[[str, float], list[str]]


STEPS = [
    Step("paged_attention", "paged_attention_gpu.py", 0.35, paged_attention_args),
    Step("gpu_check", "gpu_check.py", 0.45, gpu_check_args),
    Step("aoti_probe", "aoti_probe.py", 0.2, aoti_probe_args),
]


def install(site: Path) -> str:
    """The repository installed into ``site`` as the GPU machine's docs do it (pip, no network); where that pip
    cannot build it (a setuptools older than the ``license`` field's form needs: 77), the same layout copied:
    ``trtbuild/`` with ``plugins/`` as ``trtbuild/plugins`` (pyproject's package-dir). Returns how it went."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
           "--target", str(site), str(ROOT)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=site.parent, check=False)
    if proc.returncode == 0:
        return "pip"
    shutil.rmtree(site, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "trtbuild", site / "trtbuild", ignore=ignore)
    shutil.copytree(ROOT / "plugins", site / "trtbuild" / "plugins", ignore=ignore)
    why = next((line.strip() for line in reversed(proc.stderr.splitlines()) if "Error" in line), "pip failed")
    return f"copied (pip: {why[:200]})"


def run_step(step: Step, device: str, limit_s: float, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """Run one step, passing its lines through; killed at ``limit_s``. Its summary: exit status, seconds, counts."""
    cmd = [sys.executable, "-X", "faulthandler", str(ROOT / "benchmarks" / step.script), *step.args(device, limit_s)]
    t0 = time.perf_counter()
    # a process group of its own: killing it at the limit kills the case process the script is running too
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                            cwd=cwd, start_new_session=True)  # fmt: skip
    records: list[dict[str, Any]] = []
    tail: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except ValueError:
                    tail.append(line.rstrip())
            else:
                tail[:] = [*tail[-19:], line.rstrip()]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the case process it runs
        proc.wait()
        rc = 124
    reader.join(timeout=10)
    names = [r.get("case") or r.get("probe") for r in records]
    failed = [n for r, n in zip(records, names, strict=True) if r.get("ok") is False and "skipped" not in r]
    failed += [n for r, n in zip(records, names, strict=True) if "error" in r and n not in failed]
    return {"step": step.name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1), "limit_s": round(limit_s),
            "lines": len(records), "failed": failed,
            "skipped": [n for r, n in zip(records, names, strict=True) if r.get("skipped")],
            # None: the step ended without its done line (killed, crashed), so which outputs were wrong is unknown
            "wrong": next((r["wrong"] for r in records if r.get("kind") == "done"), [] if rc == 0 else None),
            "tail": tail[-8:] if rc else []}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=540.0, help="seconds for the whole session, install too")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the scripts' CPU modes")
    parser.add_argument("--only", default=None, help="comma-separated steps: " + ",".join(s.name for s in STEPS))
    args = parser.parse_args()
    deadline = time.perf_counter() + args.budget_s
    steps = [s for s in STEPS if args.only is None or s.name in args.only.split(",")]
    if not steps:
        parser.error(f"--only names no step of {[s.name for s in STEPS]}")
    site = Path(tempfile.mkdtemp(prefix="trtbuild-gpu-session-"))
    try:
        return run_session(args, steps, deadline, site)
    finally:  # the install, and every step's scratch (TMPDIR), a killed step's too: 0.5-2 GB a run
        shutil.rmtree(site, ignore_errors=True)


def run_session(args: argparse.Namespace, steps: list[Step], deadline: float, site: Path) -> int:
    """Install into ``site``, then run ``steps`` with their scratch folders under ``site/tmp``, each in its share."""
    summary: dict[str, Any] = {"kind": "session", "device": args.device, "budget_s": args.budget_s}
    t0 = time.perf_counter()
    summary["install"] = install(site / "site")
    summary["install_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({"kind": "install", "how": summary["install"], "seconds": summary["install_s"]}), flush=True)
    (site / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": str(site / "site"), "PYTHONUNBUFFERED": "1", "TMPDIR": str(site / "tmp")}
    results = []
    for index, step in enumerate(steps):
        left = deadline - time.perf_counter()
        later = sum(s.share for s in steps[index + 1 :])
        limit = left * step.share / (step.share + later)  # its share of what is left: earlier slack carries on
        results.append(run_step(step, args.device, limit, env, site))
    summary.update(steps=results, total_s=round(args.budget_s - (deadline - time.perf_counter()), 1))
    text = json.dumps(summary)
    print(text, flush=True)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "gpu_session.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
