"""Which machine a torch engine is for, and picking the engine of an engine directory that runs on this one.

An AOTInductor package holds code generated for one device type and target: on CUDA the GPU architecture of the
build GPU (``cuda-sm90``), on the CPU the vector ISA Inductor compiled for (``cpu-avx512``). It is loaded by the
torch version that built it (same major.minor). A torch-compile engine (``compile-cuda``, ``compile-cpu``) is
compiled when it is opened, so it needs only its device type. A mismatch is refused with the command that rebuilds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...artifacts.engine_select import EngineEntry, arch_name, entries_from_manifest
from ...config import TorchDevice, TorchRuntime
from ...errors import BuildError, EngineError


def local_target(device: TorchDevice) -> str:
    """``cuda-sm90`` (this machine's GPU) or ``cpu-avx512`` (torch's CPU capability); BuildError without a GPU."""
    import torch

    if device is TorchDevice.CUDA:
        if not torch.cuda.is_available():
            raise BuildError(
                "--device cuda needs an NVIDIA GPU and torch finds none (torch.cuda.is_available() is False); "
                "build on the GPU machine or use --device cpu"
            )
        return "cuda-" + arch_name(torch.cuda.get_device_capability(0))
    return "cpu-" + torch.backends.cpu.get_cpu_capability().lower()


def compile_target(device: TorchDevice) -> str:
    """The target of a torch-compile engine: ``compile-cuda`` or ``compile-cpu`` (any GPU architecture, any ISA)."""
    return f"compile-{device.value}"


def entry_device(entry: EngineEntry) -> TorchDevice:
    """The device type of a torch engine entry (``cuda-sm90``, ``cpu-avx512``, ``compile-cuda`` ...)."""
    return TorchDevice(entry.target.removeprefix("compile-").split("-")[0])


def entry_runtime(entry: EngineEntry) -> TorchRuntime:
    """The runtime of a torch engine entry (entries written before the field existed are AOTInductor packages)."""
    return TorchRuntime(entry.torch_runtime or TorchRuntime.AOT_INDUCTOR.value)


def rebuild_command(device: str, engine_dir: str, checkpoint: str = "CKPT_DIR") -> str:
    return f"trtbuild build {checkpoint} -o {engine_dir} --backend torch --device {device}"


def select_torch_engine(manifest: Mapping[str, Any], engine_dir: str) -> EngineEntry:
    """The torch engine of ``manifest`` that runs here, or ``EngineError`` naming each and the rebuild command."""
    import torch

    entries = [e for e in entries_from_manifest(manifest) if e.backend == "torch"]
    if not entries:
        raise EngineError(f"{engine_dir} has no torch engine; build one with {rebuild_command('cuda', engine_dir)}")
    here_torch = _major_minor(torch.__version__)
    reasons = []
    for entry in entries:
        device = entry_device(entry)
        try:
            here = local_target(device)
        except BuildError:
            reasons.append(f"{entry.target}: this machine has no NVIDIA GPU")
            continue
        if entry_runtime(entry) is TorchRuntime.TORCH_COMPILE:
            return entry  # compiled at load for whatever this device is
        why = []
        if entry.target != here:
            why.append(f"built for {entry.target}, this machine is {here}")
        if _major_minor(entry.torch_version or "") != here_torch:
            why.append(f"built with torch {entry.torch_version}, installed is {torch.__version__}")
        if not why:
            return entry
        reasons.append(f"{entry.target}: {'; '.join(why)}")
    device_name = entry_device(entries[0]).value
    raise EngineError(
        f"no torch engine in {engine_dir} runs on this machine ({'; '.join(reasons)}). "
        f"Rebuild with: {rebuild_command(device_name, engine_dir)}"
    )


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])
