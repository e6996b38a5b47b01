"""Opening an engine: the session of the backend an engine directory was built with.

A session (``EngineSession``, in ``engine_session.py``) runs one step of the model over a ragged batch through a
paged KV cache; every backend's session has the same interface. The implementations are registered here by module
name (``SESSION_MODULES``) and imported when an engine of theirs is opened: the backends import the runtime, the
runtime imports no backend (``tests/test_layering.py``).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..config import Backend, RuntimeConfig
from .engine_session import EngineSession

__all__ = ["SESSION_MODULES", "EngineSession", "open_session"]

# Backend -> the module whose ``open_session(engine_dir, *, kv_cache_memory, num_threads, profile_kernels)``
# returns its ``EngineSession``.
SESSION_MODULES: dict[Backend, str] = {
    Backend.ONNXRUNTIME: "trtbuild.backends.onnxruntime.session",
    Backend.TENSORRT: "trtbuild.backends.tensorrt.session",
    Backend.TORCH: "trtbuild.backends.torch.session",
}


def open_session(
    engine_dir: Path,
    *,
    kv_cache_memory: int | None,
    num_threads: int | None = None,
    verify: bool = False,
    profile_kernels: bool = False,
    unfinished: bool = False,
) -> EngineSession:
    """The session for the backend ``engine_dir`` was built with (its ``SESSION_MODULES`` module, imported now).

    ``manifest.json`` must be there and every file it lists must have its recorded size; ``verify`` also checks
    their sha256 (slower: it reads every byte) so that a file changed in place is refused rather than run.
    ``unfinished``: the engine a build is still writing (its accuracy gate runs before the manifest exists), opened
    without those checks. ``profile_kernels``: onnxruntime sessions run its profiler (``OrtSession.kernel_times``);
    others ignore it.
    """
    from ..artifacts.verify import check_engine_files
    from ..errors import EngineError

    engine_dir = Path(engine_dir)
    if not (engine_dir / "runtime_config.json").is_file():
        raise EngineError(f"{engine_dir}: not an engine directory (no runtime_config.json); run `trtbuild build`")
    try:
        config = RuntimeConfig.load(engine_dir)
    except Exception as e:
        raise EngineError(f"{engine_dir}: corrupt runtime_config.json ({e})") from None
    if not unfinished:
        check_engine_files(engine_dir, hashes=verify)
    backend = importlib.import_module(SESSION_MODULES[config.build.backend])
    return backend.open_session(
        engine_dir, kv_cache_memory=kv_cache_memory, num_threads=num_threads, profile_kernels=profile_kernels
    )
