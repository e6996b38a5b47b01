"""Why does an AOTInductor CUDA package segfault at load on the GPU machine? One child process per hypothesis.

Every probe compiles (where it needs to) and loads a plain ``Linear(64, 64) + ReLU`` package, in its own
``python -X faulthandler`` child (``trtbuild.backends.torch.build.isolate``), so a segfault is one JSON line with its
exit status and the fault's last lines, and the run goes on. Independent probes run in parallel (the machine's
cores compile at once). Run on the GPU machine, from the repository root, after installing the project there
(docs/gpu.md)::

    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/aoti_probe.py          # ~2-3 minutes
    python3 benchmarks/aoti_probe.py --device cpu                                   # the CPU mode (checks this script)

Probes (each prints ``{"probe": ..., "ok": ..., "rc": ..., "stage": <the last stage reached>, "trace": [...]}``):
- ``environment``: torch / CUDA / Triton / nvcc / g++ / driver versions, the CUDA home torch finds, the CUDA
  runtime library the process maps once CUDA is initialised (headers of one version, runtime of another?).
- ``default``: compile with Inductor's defaults in one child, load it in a fresh one (the failure seen on the H200).
- ``cuda_gdb_backtrace``: that load under ``cuda-gdb -batch -ex run -ex bt``: the native frames of the fault.
- ``cuda_home_torch_wheels`` / ``cuda_home_triton``: ``CUDA_HOME`` pointed at the CUDA headers of torch's
  ``nvidia-*`` wheels / at Triton's bundled headers (+ the driver's libcuda), compiled and loaded in one child.
- ``no_embedded_kernels``: ``aot_inductor.embed_kernel_binary=False`` (cubins as files beside the library).
- ``weights_outside_so``: ``package_constants_in_so=False`` (weights in the package, not linked into the .so).
- ``no_precompiled_headers``: ``precompile_headers=False``.
- ``multi_arch``: ``emit_multi_arch_kernel=True`` (PTX + fatbinary through nvcc).
- ``cpu_package``: a CPU package on the same machine: is the loader itself broken, or only the CUDA path?
- ``in_process``: compile and load in the same child (the building process).
An option this torch does not have makes its probe ``"skipped"``. With ``$OUT`` set the lines also go to
``$OUT/aoti_probe.jsonl``; the last line is a summary naming the probes that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from trtbuild.backends.torch.build.isolate import IsolatedRun, report, run_isolated

START = time.perf_counter()
HERE = Path(__file__).resolve().parent

# The child: ``aoti_probe.py``'s ``child`` function, run by path (the benchmarks folder is not a package).
CHILD = (
    "import sys, runpy; mod = runpy.run_path(sys.argv[1]); "
    "mod['child'](sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:])"
)


def stage(name: str) -> None:
    """In a child: the stage reached (the parent reports the last one printed before a crash)."""
    print(f"STAGE {name}", flush=True)


def _options(names: dict[str, Any]) -> dict[str, Any]:
    """Inductor options by dotted name; SystemExit(3) (the probe is skipped) when this torch lacks one."""
    import torch

    for dotted in names:
        section, _, attr = dotted.rpartition(".")
        owner = torch._inductor.config if not section else getattr(torch._inductor.config, section)
        if not hasattr(owner, attr):
            print(f"SKIP this torch has no inductor option {dotted}", flush=True)
            raise SystemExit(3)
    return names


def child(action: str, device: str, package: str, options_json: str, extra: list[str]) -> None:
    """``compile`` / ``load`` / ``both`` the plain package at ``package`` with the Inductor ``options``."""
    import torch

    options = _options(json.loads(options_json))
    stage("imported torch")
    if device == "cuda":
        torch.cuda.init()
        stage("cuda initialised")
    example = (torch.randn(8, 64, device=device),)
    if action in ("compile", "both"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).to(device).eval()
        with torch.no_grad():
            program = torch.export.export(model, example)
        stage("exported")
        torch._inductor.aoti_compile_and_package(program, package_path=package, inductor_configs=options)
        stage("compiled")
        report({"package_bytes": os.path.getsize(package), "files": _package_files(package), "ldd": _ldd(package)})
    if action in ("load", "both"):
        stage("loading")
        runner = torch._inductor.aoti_load_package(package)
        stage("loaded")
        with torch.no_grad():
            out = runner(*example)
        if device == "cuda":
            torch.cuda.synchronize()
        stage("ran")
        report({"output_shape": list(out.shape), "finite": bool(torch.isfinite(out).all())})


def _package_files(package: str) -> list[str]:
    import zipfile

    with zipfile.ZipFile(package) as z:
        return sorted(n.rsplit("/", 1)[-1] for n in z.namelist() if not n.endswith("/"))[:40]


def _ldd(package: str) -> list[str]:
    """``ldd`` of the package's wrapper library: which libtorch / libcuda / libstdc++ it resolves to here."""
    import subprocess
    import zipfile

    with zipfile.ZipFile(package) as z, tempfile.TemporaryDirectory() as tmp:
        names = [n for n in z.namelist() if n.endswith(".so")]
        if not names:
            return []
        path = z.extract(names[0], tmp)
        try:
            out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            return [f"ldd: {e}"]
    return [" ".join(line.split()[:3]) for line in out.splitlines()][:30]


def environment(device: str) -> dict[str, Any]:
    """Versions and paths, gathered in a child (importing torch with CUDA can crash too)."""
    code = r"""
import json, os, platform, shutil, subprocess, sys
from trtbuild.backends.torch.build.isolate import report
def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[-3:]
    except Exception as e:
        return f"{type(e).__name__}: {e}"
info = {"python": sys.version.split()[0], "platform": platform.platform(), "glibc": platform.libc_ver()}
import torch
info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cxx11_abi=torch._C._GLIBCXX_USE_CXX11_ABI)
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
from torch.utils import cpp_extension
info["cuda_home_found_by_torch"] = cpp_extension.CUDA_HOME
info["CUDA_HOME_env"] = os.environ.get("CUDA_HOME")
info["nvcc"] = shutil.which("nvcc")
info["nvcc_version"] = run("nvcc", "--version") if info["nvcc"] else None
home = cpp_extension.CUDA_HOME
info["cuda_home_nvcc_version"] = run(os.path.join(home, "bin", "nvcc"), "--version") if home else None
cxx = os.environ.get("CXX", "g++")
info["cxx"] = shutil.which(cxx)
try:
    info["cxx_version"] = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    libstdcxx = [cxx, "-print-file-name=libstdc++.so.6"]
    info["cxx_libstdcxx"] = os.path.realpath(subprocess.run(libstdcxx, capture_output=True, text=True).stdout.strip())
except OSError as e:
    info["cxx_version"] = str(e)
info["system_gxx"] = [p for p in ("/usr/bin/g++", "/usr/bin/g++-14", "/usr/bin/g++-13") if os.path.exists(p)]
smi = ("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader")
info["nvidia_smi"] = run(*smi) if shutil.which("nvidia-smi") else None
info["cuda_gdb"] = shutil.which("cuda-gdb")
if sys.argv[1] == "cuda" and torch.cuda.is_available():
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    info["gpu"] = torch.cuda.get_device_name(0)
    info["capability"] = list(torch.cuda.get_device_capability(0))
    maps = open("/proc/self/maps").read().split("\n")
    keys = ("libcudart", "libcuda.so", "libnvrtc", "libcublas.so", "libstdc++")
    libs = sorted({l.split()[-1] for l in maps if any(k in l for k in keys)})
    info["mapped_cuda_libraries"] = libs
report(info)
"""
    run = run_isolated(code, args=[device], timeout=90)
    return {"ok": run.ok, "rc": run.rc, **(run.results[0] if run.results else {}), "trace": run.trace[-8:]}


def probe(name: str, device: str, work: Path, action: str, options: dict[str, Any], env: dict[str, str] | None = None,
          package: Path | None = None, timeout: float = 240.0) -> dict[str, Any]:  # fmt: skip
    """One child: ``action`` on ``package`` (default ``work/<name>.pt2``) with ``options`` and extra ``env``."""
    package = package or work / f"{name}.pt2"
    args = [str(Path(__file__).resolve()), action, device, str(package), json.dumps(options)]
    run = run_isolated(CHILD, args=args, env=env, timeout=timeout)
    return line(name, run, options=options, env=env or {})


def line(name: str, run: IsolatedRun, **fields: Any) -> dict[str, Any]:
    stages = [t.removeprefix("STAGE ") for t in run.trace if t.startswith("STAGE ")]
    skipped = next((t.removeprefix("SKIP ") for t in run.trace if t.startswith("SKIP ")), None)
    out: dict[str, Any] = {"probe": name, "ok": run.ok, "rc": run.rc, "seconds": round(run.seconds, 1)}
    if skipped:
        out.update(ok=None, skipped=skipped)
    out["stage"] = stages[-1] if stages else None
    for result in run.results:
        out.update(result)
    out.update(fields)
    if not run.ok:
        out["summary"] = run.summary()
        out["trace"] = [t for t in run.trace if not t.startswith("STAGE ")][-14:]
    return out


def cuda_gdb_backtrace(device: str, package: Path) -> dict[str, Any]:
    """The default package's load under cuda-gdb: the native stack of the fault."""
    gdb = shutil.which("cuda-gdb")
    if device != "cuda" or gdb is None:
        return {"probe": "cuda_gdb_backtrace", "ok": None, "skipped": "no cuda-gdb" if device == "cuda" else "cpu"}
    if not package.exists():
        return {"probe": "cuda_gdb_backtrace", "ok": None, "skipped": "the default probe built no package"}
    load = (
        "import torch, sys; torch.cuda.init(); r = torch._inductor.aoti_load_package(sys.argv[1]); "
        "print('loaded', flush=True)"
    )
    cmd = [gdb, "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 40", "-ex", "info sharedlibrary",
           "--args", sys.executable, "-c", load, str(package)]  # fmt: skip
    code = "import subprocess, sys; r = subprocess.run(sys.argv[1:]); sys.exit(r.returncode)"
    run = run_isolated(code, args=cmd, timeout=150, tail=300)
    frames = [t for t in run.trace if t.startswith("#")]
    signal = [t for t in run.trace if "signal" in t.lower() or "SIG" in t][-3:]
    libs = [t for t in run.trace if "aoti" in t.lower() or (".so" in t and "model" in t.lower())][-6:]
    return {"probe": "cuda_gdb_backtrace", "ok": run.ok, "rc": run.rc, "seconds": round(run.seconds, 1),
            "signal": signal, "frames": [f[:300] for f in frames[:24]], "package_libraries": libs,
            "trace": [] if frames else run.trace[-30:]}  # fmt: skip


def torch_wheel_cuda_home(work: Path) -> tuple[str | None, str]:
    """A CUDA home made of the ``nvidia-*`` wheels' include folders beside torch (and the driver's libcuda)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None, "no nvidia-* wheels beside torch"
    includes = [d for root in spec.submodule_search_locations for d in Path(root).rglob("include") if d.is_dir()]
    if not any((d / "cuda_runtime_api.h").exists() for d in includes):
        return None, "the nvidia-* wheels hold no cuda_runtime_api.h"
    home = work / "cuda-home-wheels"
    (home / "include").mkdir(parents=True, exist_ok=True)
    for include in includes:
        for entry in include.iterdir():
            target = home / "include" / entry.name
            if not target.exists():
                target.symlink_to(entry, target_is_directory=entry.is_dir())
    _link_libcuda(home)
    return str(home), ", ".join(str(d) for d in includes[:6])


def triton_cuda_home(work: Path) -> tuple[str | None, str]:
    """The CUDA home the build makes where torch finds none (``writer.triton_cuda_home``), forced here."""
    from trtbuild.backends.torch.build.writer import triton_cuda_home as make_home

    home = make_home(work / "cuda-home-triton")
    if home is None:
        return None, "no Triton NVIDIA backend with its cuda.h, or no driver libcuda"
    return str(home), str((home / "include").resolve())


def _link_libcuda(home: Path, dirs: list[Path] | None = None) -> None:
    (home / "lib64").mkdir(exist_ok=True)
    for d in [*(dirs or []), Path("/usr/local/nvidia/lib64"), Path("/usr/lib/x86_64-linux-gnu")]:
        if (d / "libcuda.so.1").exists() and not (home / "lib64" / "libcuda.so").exists():
            (home / "lib64" / "libcuda.so").symlink_to(d / "libcuda.so.1")


def libstdcxx_probes() -> dict[str, dict[str, str]]:
    """The fix candidates for the fault seen on the H200 (2026-12-04): the wrapper library's ``std::regex`` (in
    ``parse_device_str``), compiled with the headers of the compiler Inductor runs (``/opt/gcc``), crashes on the
    older ``libstdc++`` the process has loaded. Either compile with the system's g++ (headers that match the loaded
    library) or load the compiler's own ``libstdc++`` first (``LD_PRELOAD``)."""
    import subprocess

    probes: dict[str, dict[str, str]] = {}
    for cxx in ("/usr/bin/g++", "/usr/bin/g++-14", "/usr/bin/g++-13", "/usr/bin/g++-12"):
        if os.path.exists(cxx):
            probes["system_gxx"] = {"CXX": cxx}
            break
    cxx = os.environ.get("CXX") or shutil.which("g++") or "g++"
    try:
        lib = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True, timeout=30)
        path = os.path.realpath(lib.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        path = ""
    if os.path.isabs(path) and os.path.exists(path):
        probes["preload_compiler_libstdcxx"] = {"LD_PRELOAD": path}
    return probes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the probes on CPU packages")
    parser.add_argument("--jobs", type=int, default=6, help="probes compiling at once")
    parser.add_argument("--only", default=None, help="comma-separated probe names to run (default: all)")
    parser.add_argument("--timeout", type=float, default=240.0,
                        help="seconds a probe's child may take (one cut reports its last stage); under a caller's "
                             "limit, less than that limit")  # fmt: skip
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trtbuild-aoti-probe-"))
    try:
        run_probes(args, work)
    finally:  # its packages (a killed run leaves them: gpu_session's TMPDIR holds them, and it removes that)
        shutil.rmtree(work, ignore_errors=True)


def run_probes(args: argparse.Namespace, work: Path) -> None:
    """Every probe (``--only``: those named), ``--jobs`` at a time, each line as it ends; then the summary line."""
    timeout = args.timeout
    device = args.device
    out_file = Path(os.environ["OUT"]) / "aoti_probe.jsonl" if os.environ.get("OUT") else None
    lines: list[dict[str, Any]] = []
    lock = threading.Lock()  # the default chain emits from its worker thread

    def emit(entry: dict[str, Any]) -> None:
        with lock:
            entry = {"t": round(time.perf_counter() - START, 1), **entry}
            lines.append(entry)
            text = json.dumps(entry, default=str)
            print(text, flush=True)
            if out_file is not None:
                with out_file.open("a") as f:
                    f.write(text + "\n")

    emit({"probe": "environment", **environment(device)})
    default = work / "default.pt2"
    parallel: list[tuple[str, Any]] = [  # (name, a thunk returning its line); default/compile: default_chain
        ("in_process", lambda: probe("in_process", device, work, "both", {}, timeout=timeout)),
        ("cpu_package", lambda: probe("cpu_package", "cpu", work, "both", {}, timeout=timeout)),
    ]
    if device == "cuda":
        homes = {"cuda_home_torch_wheels": torch_wheel_cuda_home, "cuda_home_triton": triton_cuda_home}
        for name, make in homes.items():
            home, where = make(work)
            if home is None:
                emit({"probe": name, "ok": None, "skipped": where})
            else:
                parallel.append((name, lambda n=name, h=home: probe(n, device, work, "both", {}, env={"CUDA_HOME": h},
                                                                   timeout=timeout)))  # fmt: skip
        variants = {
            "no_embedded_kernels": {"aot_inductor.embed_kernel_binary": False},
            "weights_outside_so": {"aot_inductor.package_constants_in_so": False},
            "no_precompiled_headers": {"aot_inductor.precompile_headers": False},
            "multi_arch": {"aot_inductor.emit_multi_arch_kernel": True},
        }
        for name, opts in variants.items():
            parallel.append((name, lambda n=name, o=opts: probe(n, device, work, "both", o, timeout=timeout)))
    for name, env in libstdcxx_probes().items():
        parallel.append((name, lambda n=name, e=env: probe(n, device, work, "both", {}, env=e, timeout=timeout)))

    def default_chain() -> list[dict[str, Any]]:
        """Compile with the defaults, load in a fresh process, then the same load under cuda-gdb: each line as soon
        as its probe ends (on the H200 the chain takes ~3.5 minutes, more than a session's share)."""
        emit(probe("default/compile", device, work, "compile", {}, package=default, timeout=timeout))
        if not default.exists():
            return [{"probe": "default/load", "ok": None, "skipped": "default/compile built no package"}]
        emit(probe("default/load", device, work, "load", {}, package=default, timeout=min(120.0, timeout)))
        return [cuda_gdb_backtrace(device, default)]

    chains = [("default/compile", default_chain)] + [(name, lambda f=fn: [f()]) for name, fn in parallel]
    if args.only:
        wanted = set(args.only.split(","))
        chains = [(name, fn) for name, fn in chains if name in wanted]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # each line as soon as its probe ends
        futures = {pool.submit(fn): name for name, fn in chains}
        for future in as_completed(futures):
            try:
                results = future.result()
            except Exception as e:  # the harness itself: report and go on
                results = [{"probe": futures[future], "ok": False, "error": f"{type(e).__name__}: {e}"}]
            for result in results:
                emit(result)
    ran = [entry["probe"] for entry in lines]
    failed = [entry["probe"] for entry in lines if entry.get("ok") is False]
    working = [entry["probe"] for entry in lines if entry.get("ok") is True and entry.get("stage") == "ran"]
    emit({"probe": "summary", "total_s": round(time.perf_counter() - START, 1), "ran": ran, "failed": failed,
          "loaded_and_ran": working})  # fmt: skip


if __name__ == "__main__":
    main()
