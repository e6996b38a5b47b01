"""The target a torch build writes: this machine's (``cuda-sm90``, ``cpu-avx512``) for an AOTInductor package, the
device type alone (``compile-cuda``) for a torch-compile engine. Which engine runs where is
``artifacts.torch_select``'s, which the session and ``trtbuild verify`` share.
"""

from __future__ import annotations

from ...artifacts.torch_select import TorchFacts
from ...config import TorchDevice
from ...errors import BuildError


def local_target(device: TorchDevice) -> str:
    """``cuda-sm90`` (this machine's GPU) or ``cpu-avx512`` (torch's CPU capability); BuildError without a GPU."""
    target = TorchFacts.detect().target(device)
    if target is None:
        raise BuildError(
            "--device cuda needs an NVIDIA GPU and torch finds none (torch.cuda.is_available() is False); "
            "build on the GPU machine or use --device cpu"
        )
    return target


def compile_target(device: TorchDevice) -> str:
    """The target of a torch-compile engine: ``compile-cuda`` or ``compile-cpu`` (any GPU architecture, any ISA)."""
    return f"compile-{device.value}"
