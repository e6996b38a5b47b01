"""Pick the engine of an engine directory that runs on this machine, or say exactly why none does (no TensorRT).

A TensorRT engine runs only on the GPU architecture it was built for (unless built with hardware compatibility
``ampere+``: any GPU from sm80 on), only with the TensorRT version that built it (unless version-compatible: that
version or a later one of the same major; otherwise the exact version, build number included), only with the
plugin version it was built with, and only on a driver that loads the PTX ISA of its embedded plugin kernel. The
manifest lists one :class:`EngineEntry` per engine under ``"engines"``; :func:`select_engine` checks each against the
:class:`LocalFacts` and raises :class:`~trtbuild.errors.EngineError` naming every engine, why it does not fit,
and the ``trtbuild build`` command that makes one that does.

It belongs to the engine directory's contract (the manifest's engine entries), so it lives with the manifest: the
builds write entries (``backends/*/build/``), ``verify.py`` and the sessions read them, and none of those imports
another for it.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import EngineError
from .ptx import driver_cuda_version, max_ptx_for_cuda, ptx_number

HARDWARE_COMPATIBILITY = ("none", "ampere+")
AMPERE = (8, 0)


@dataclass(frozen=True)
class EngineEntry:
    """One engine of an engine directory, as listed in ``manifest.json["engines"]``."""

    backend: str  # "tensorrt", "onnxruntime" or "torch"
    target: str  # tensorrt: "sm90" (the arch it was built for); onnxruntime: "cpu-x86_64-linux"; torch: "cuda-sm90"
    path: str  # relative to the engine directory, e.g. "engines/tensorrt-sm90/engine.plan"
    tensorrt_version: str | None = None  # e.g. "10.9.0.34"; None for other backends
    compute_capability: str | None = None  # of the build GPU, e.g. "9.0"
    hardware_compatibility: str = "none"  # "none" or "ampere+"
    version_compatible: bool = False
    plugin_version: str | None = None  # trtbuild.plugins.paged_attention.tensorrt_plugin.PLUGIN_VERSION
    ptx_version: str | None = None  # PTX ISA of the embedded AOT plugin kernel, e.g. "8.5"; None: JIT plugin
    torch_version: str | None = None  # torch engines: the torch that exported and compiled the package
    triton_version: str | None = None  # torch engines: the Triton that generated its GPU kernels
    torch_runtime: str | None = None  # torch engines: a ``TorchRuntime`` value ("torch-compile", "aot-inductor")

    def __post_init__(self) -> None:
        if self.hardware_compatibility not in HARDWARE_COMPATIBILITY:
            raise ValueError(f"hardware_compatibility must be one of {HARDWARE_COMPATIBILITY}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineEntry:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise EngineError(f"manifest engine entry has unknown field(s) {sorted(unknown)}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as e:
            raise EngineError(f"manifest engine entry {dict(data)} is invalid ({e})") from None

    def describe(self) -> str:
        if self.backend == "torch":
            return f"torch {self.target} ({self.torch_runtime}), torch {self.torch_version}"
        if self.backend != "tensorrt":
            return f"{self.backend} {self.target}"
        portable = " (ampere+: any GPU >= sm80)" if self.hardware_compatibility == "ampere+" else ""
        vc = ", version-compatible" if self.version_compatible else ""
        return f"tensorrt {self.target}{portable}, TensorRT {self.tensorrt_version}{vc}, plugin {self.plugin_version}"


@dataclass(frozen=True)
class LocalFacts:
    """What this machine offers: GPU compute capability, TensorRT version, plugin version (None: absent), and the
    highest PTX ISA its driver loads (e.g. 85; None: unknown or newer than any ISA trtbuild knows)."""

    compute_capability: tuple[int, int] | None
    tensorrt_version: str | None
    plugin_version: str | None
    driver_ptx_version: int | None = None

    @property
    def arch(self) -> str | None:
        return None if self.compute_capability is None else arch_name(self.compute_capability)


def arch_name(compute_capability: tuple[int, int]) -> str:
    """``(9, 0)`` -> ``"sm90"``."""
    return f"sm{compute_capability[0]}{compute_capability[1]}"


def parse_arch(arch: str) -> tuple[int, int]:
    """``"sm90"``, ``"sm_90"``, ``"90"``, ``"9.0"`` -> ``(9, 0)``; ``"sm120"`` -> ``(12, 0)``."""
    text = arch.strip().lower().removeprefix("sm").removeprefix("_")
    if "." in text:
        major, _, minor = text.partition(".")
    else:
        major, minor = text[:-1], text[-1:]
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"not a GPU arch: {arch!r} (expected e.g. sm80, sm86, sm89, sm90, sm120)")
    return int(major), int(minor)


def entries_from_manifest(manifest: Mapping[str, Any]) -> list[EngineEntry]:
    """The engine entries of a manifest (a manifest without ``"engines"`` describes its one engine at top level)."""
    if "engines" in manifest:
        return [EngineEntry.from_dict(e) for e in manifest["engines"]]
    if "backend" in manifest:
        return [EngineEntry(backend=manifest["backend"], target=str(manifest.get("target", "?")), path="")]
    return []


def select_engine(
    manifest: Mapping[str, Any] | Sequence[EngineEntry],
    local: LocalFacts,
    *,
    backend: str = "tensorrt",
    engine_dir: str = "ENGINE_DIR",
    checkpoint: str = "CKPT_DIR",
) -> EngineEntry:
    """The best ``backend`` engine that runs here (an exact-arch engine before an ``ampere+`` one).

    Raises ``EngineError`` listing each engine and why it does not run, plus the command that builds one.
    """
    entries = list(manifest) if not isinstance(manifest, Mapping) else entries_from_manifest(manifest)
    candidates = [e for e in entries if e.backend == backend]
    if backend == "tensorrt":
        if local.compute_capability is None:
            raise EngineError(
                "TensorRT engines need an NVIDIA GPU and none was found; run the onnxruntime engine instead "
                f"(trtbuild build {checkpoint} -o {engine_dir} --backend onnxruntime)"
            )
        if local.tensorrt_version is None:
            raise EngineError(
                "TensorRT is not installed: pip install 'trtbuild[tensorrt]' --extra-index-url https://pypi.nvidia.com"
            )
    fits = [e for e in candidates if backend != "tensorrt" or not mismatches(e, local)]
    if fits:
        return sorted(fits, key=lambda e: e.hardware_compatibility != "none")[0]
    return _raise_no_engine(entries, candidates, local, backend, engine_dir, checkpoint)


def mismatches(entry: EngineEntry, local: LocalFacts) -> list[str]:
    """Why a TensorRT ``entry`` cannot run on ``local`` (empty: it can)."""
    reasons = []
    cc = local.compute_capability
    if entry.hardware_compatibility == "ampere+":
        if cc is None or cc < AMPERE:
            reasons.append(f"ampere+ engines need sm80 or newer, this GPU is {local.arch}")
    elif entry.target != local.arch:
        reasons.append(f"built for {entry.target}, this GPU is {local.arch}")
    built, here = _version(entry.tensorrt_version), _version(local.tensorrt_version)
    if entry.version_compatible:
        if not (built and here and here[0] == built[0] and here >= built):
            reasons.append(
                f"built with TensorRT {entry.tensorrt_version} (version-compatible: runs on "
                f"{built[0] if built else '?'}.x >= {entry.tensorrt_version}), installed is {local.tensorrt_version}"
            )
    elif built != here:  # the full version, build number included
        reasons.append(f"built with TensorRT {entry.tensorrt_version}, installed is {local.tensorrt_version}")
    if entry.plugin_version != local.plugin_version:
        reasons.append(f"built with plugin {entry.plugin_version}, this trtbuild has plugin {local.plugin_version}")
    ptx_here = local.driver_ptx_version
    if entry.ptx_version and ptx_here is not None and ptx_number(entry.ptx_version) > ptx_here:
        reasons.append(
            f"its plugin kernel is PTX ISA {entry.ptx_version} and this driver loads PTX <= {ptx_here // 10}."
            f"{ptx_here % 10} (update the driver, or rebuild with --ptx-version {ptx_here})"
        )
    return reasons


def build_command(checkpoint: str, engine_dir: str, arch: str, *, portable: bool = False) -> str:
    """The ``trtbuild build`` command that makes a TensorRT engine for ``arch``."""
    extra = " --hardware-compatibility ampere+" if portable else ""
    return f"trtbuild build {checkpoint} -o {engine_dir} --backend tensorrt --arch {arch}{extra}"


def _raise_no_engine(
    entries: list[EngineEntry],
    candidates: list[EngineEntry],
    local: LocalFacts,
    backend: str,
    engine_dir: str,
    checkpoint: str,
) -> EngineEntry:
    if backend != "tensorrt":
        have = ", ".join(e.describe() for e in entries) or "nothing"
        raise EngineError(f"{engine_dir} has no {backend} engine (it has: {have})")
    arch = local.arch or "native"
    need = f"needed: {arch}, TensorRT {local.tensorrt_version}, plugin {local.plugin_version}"
    if candidates:
        found = "; ".join(f"{e.describe()} [{'; '.join(mismatches(e, local))}]" for e in candidates)
    else:
        found = "no TensorRT engine (it has: " + (", ".join(e.describe() for e in entries) or "nothing") + ")"
    arch_ok = [e for e in candidates if not any(r.startswith(("built for", "ampere+")) for r in mismatches(e, local))]
    hint = ""
    arch_problem = len(arch_ok) < len(candidates) or not candidates
    if arch_problem and local.compute_capability is not None and local.compute_capability >= AMPERE:
        portable = build_command(checkpoint, engine_dir, arch, portable=True)
        hint = f" (or, for one engine that runs on every GPU from sm80: {portable})"
    if arch_ok and all(e.plugin_version == local.plugin_version for e in arch_ok):
        hint += f"; or install the TensorRT that built it: pip install tensorrt=={arch_ok[0].tensorrt_version}"
    raise EngineError(
        f"no engine in {engine_dir} runs on this machine ({need}). Found: {found}. "
        f"Rebuild with: {build_command(checkpoint, engine_dir, arch)}{hint}"
    )


def _version(text: str | None) -> tuple[int, ...]:
    parts = []
    for part in (text or "").split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def detect_local_facts() -> LocalFacts:
    """This machine's GPU compute capability (torch, else ``nvidia-smi``), TensorRT and plugin versions."""
    from ..plugins.paged_attention.tensorrt_plugin import PLUGIN_VERSION

    try:
        import tensorrt

        trt_version: str | None = str(tensorrt.__version__)
    except ImportError:
        trt_version = None
    driver = driver_cuda_version()
    return LocalFacts(local_compute_capability(), trt_version, PLUGIN_VERSION, driver and max_ptx_for_cuda(driver))


def local_compute_capability(device: int = 0) -> tuple[int, int] | None:
    """Compute capability of GPU ``device``, or None when there is no usable NVIDIA GPU."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(device)
            return int(major), int(minor)
    except ImportError:
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader", f"--id={device}"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
        return parse_arch(out.splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
