"""``--kv-offload-*`` flags of ``run``, ``bench`` and ``serve``: one ``KVOffloadConfig`` (``kv_offload`` kwarg).

Flag names and help come from the config's fields (their ``flag`` / ``help`` metadata), so they cannot drift.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..runtime.kv_offload.config import KVOffloadConfig
from .options import ByteSize

_TYPES = {
    "memory": ByteSize(),
    "disk": ByteSize(),
    "disk_dir": click.Path(path_type=Path, file_okay=False),
    "url": str,
}


def kv_offload_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add the KV offload flags; the command receives ``kv_offload``: a ``KVOffloadConfig``, or None when off."""
    fields = dataclasses.fields(KVOffloadConfig)
    names = {f.name: "kv_offload_" + f.name for f in fields}

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = {name: kwargs.pop(param) for name, param in names.items()}
        config = KVOffloadConfig(**{k: v for k, v in values.items() if v is not None})
        return fn(*args, kv_offload=config if config.enabled else None, **kwargs)

    for f in reversed(fields):
        wrapper = click.option(
            f.metadata["flag"], names[f.name], type=_TYPES[f.name], default=None, help=f.metadata["help"]
        )(wrapper)
    return wrapper
