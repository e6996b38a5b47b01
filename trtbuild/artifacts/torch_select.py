"""Which torch engine of an engine directory runs on this machine, and why each of the others does not.

An AOTInductor package holds code generated for one device type and target: on CUDA the GPU architecture of the
build GPU (``cuda-sm90``), on the CPU the vector ISA Inductor compiled for (``cpu-avx512``). It is loaded by the
torch version that built it (same major.minor). A torch-compile engine (``compile-cuda``, ``compile-cpu``) is
compiled when it is opened, so it needs only its device type.

It reads the manifest's engine entries, as ``engine_select`` does for TensorRT, so both the torch session (which
refuses an engine with the command that rebuilds it) and ``trtbuild verify`` (which lists every reason) use it.
torch is imported only by :meth:`TorchFacts.detect`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import TorchDevice, TorchRuntime
from ..errors import EngineError
from .engine_select import EngineEntry, arch_name, entries_from_manifest

NO_GPU = "this machine has no NVIDIA GPU"  # the one reason ``trtbuild verify`` notes rather than fails (a build host)


@dataclass(frozen=True)
class TorchFacts:
    """What this machine runs torch engines with; None where it has none of it."""

    torch_version: str | None  # the installed torch, e.g. "2.13.0+cpu"
    cuda_target: str | None  # GPU 0 as an AOTInductor target, e.g. "cuda-sm90"
    cpu_target: str | None  # the CPU ISA Inductor compiles for, e.g. "cpu-avx512"

    @classmethod
    def detect(cls) -> TorchFacts:
        try:
            import torch
        except ImportError:
            return cls(None, None, None)
        cuda = "cuda-" + arch_name(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None
        return cls(torch.__version__, cuda, "cpu-" + torch.backends.cpu.get_cpu_capability().lower())

    def target(self, device: TorchDevice) -> str | None:
        """This machine's target for ``device`` (None: no torch, or no GPU for CUDA)."""
        return self.cuda_target if device is TorchDevice.CUDA else self.cpu_target


def entry_device(entry: EngineEntry) -> TorchDevice:
    """The device type of a torch engine entry (``cuda-sm90``, ``cpu-avx512``, ``compile-cuda`` ...)."""
    return TorchDevice(entry.target.removeprefix("compile-").split("-")[0])


def entry_runtime(entry: EngineEntry) -> TorchRuntime:
    """The runtime of a torch engine entry (entries written before the field existed are AOTInductor packages)."""
    return TorchRuntime(entry.torch_runtime or TorchRuntime.AOT_INDUCTOR.value)


def rebuild_command(device: str, engine_dir: str, checkpoint: str = "CKPT_DIR") -> str:
    return f"trtbuild build {checkpoint} -o {engine_dir} --backend torch --device {device}"


def torch_mismatches(entry: EngineEntry, facts: TorchFacts) -> list[str]:
    """Why the torch engine ``entry`` does not run on a machine with ``facts``; empty when it does."""
    if facts.torch_version is None:
        return ["torch is not installed on this machine"]
    here = facts.target(entry_device(entry))
    if here is None:
        return [NO_GPU]
    if entry_runtime(entry) is TorchRuntime.TORCH_COMPILE:
        return []  # compiled at load for whatever this device is
    why = []
    if entry.target != here:
        why.append(f"built for {entry.target}, this machine is {here}")
    if _major_minor(entry.torch_version or "") != _major_minor(facts.torch_version):
        why.append(f"built with torch {entry.torch_version}, installed is {facts.torch_version}")
    return why


def torch_entries(manifest: Mapping[str, Any]) -> list[EngineEntry]:
    return [e for e in entries_from_manifest(manifest) if e.backend == "torch"]


def select_torch_engine(manifest: Mapping[str, Any], engine_dir: str, facts: TorchFacts) -> EngineEntry:
    """The torch engine of ``manifest`` that runs here, or ``EngineError`` naming each and the rebuild command."""
    entries = torch_entries(manifest)
    if not entries:
        raise EngineError(f"{engine_dir} has no torch engine; build one with {rebuild_command('cuda', engine_dir)}")
    reasons = []
    for entry in entries:
        why = torch_mismatches(entry, facts)
        if not why:
            return entry
        reasons.append(f"{entry.target}: {'; '.join(why)}")
    raise EngineError(
        f"no torch engine in {engine_dir} runs on this machine ({'; '.join(reasons)}). "
        f"Rebuild with: {rebuild_command(entry_device(entries[0]).value, engine_dir)}"
    )


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])
