"""The torch dtype of each checkpoint ``DType`` (torch is imported only when asked: readers of numpy need none)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import DType

if TYPE_CHECKING:
    import torch


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype that stores ``dtype`` (float32, float16, bfloat16)."""
    import torch

    return {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}[dtype]
