"""Shared fixtures: the tiny models of tiny_models.py, converted and built once per session; the ``gpu`` marker's
skip without CUDA, and the child process each GPU-capable case runs in (``isolated_case``)."""

from __future__ import annotations

import functools
import json
import os
import shutil

# Triton reads this at its first import: the plugin kernels' tests run in its CPU interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from tiny_models import TINY_CONFIGS, make_hf_model

TESTS = os.path.dirname(os.path.abspath(__file__))  # this folder: the isolated cases import its modules


@pytest.fixture(scope="session")
def tiny_engines(tmp_path_factory):
    """name -> (hf_model, ckpt_dir, engine_dir) for every tiny config, built once per session."""
    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig, DType
    from trtbuild.convert.convert import convert

    out = {}
    root = tmp_path_factory.mktemp("tiny")
    for name in TINY_CONFIGS:
        hf_dir, ckpt, engine = root / f"{name}-hf", root / f"{name}-ckpt", root / f"{name}-engine"
        model = make_hf_model(name, hf_dir)
        convert(hf_dir, ckpt, DType.FLOAT32)
        build_engine(ckpt, engine, BuildConfig(max_seq_len=128, kv_block_size=4))
        out[name] = (model, ckpt, engine)
    return out


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(transformers model, tokenizer, engine_dir) for the real SmolLM2-135M, converted from its GGUF once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig, DType
    from trtbuild.convert.convert import convert
    from trtbuild.demo import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    root = tmp_path_factory.mktemp("smollm2")
    convert(gguf, root / "ckpt", DType.FLOAT32, dequantize=True)
    build_engine(root / "ckpt", root / "engine", BuildConfig(max_seq_len=2048))
    shutil.rmtree(root / "ckpt")  # 540 MB the session does not read again
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model, tok, root / "engine"


@functools.cache
def cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked once (torch is imported only when a ``gpu`` test is reached)."""
    import torch

    return torch.cuda.is_available()


DISK_FREE: list[float] = []  # GiB free in the temp folder: at the session's start, then the least seen after a test


def disk_free_gib() -> float:
    """GiB free in the temp folder, where the tests write their checkpoints and engines."""
    import tempfile

    return shutil.disk_usage(tempfile.gettempdir()).free / 2**30


def pytest_sessionstart(session: pytest.Session) -> None:
    DISK_FREE[:] = [disk_free_gib()] * 2


def pytest_runtest_teardown(item: pytest.Item) -> None:
    DISK_FREE[1] = min(DISK_FREE[1], disk_free_gib())


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """One line on the disk: the slow suite's real-model engines need a few GB, and a CI run once died of ENOSPC, so
    every run's log (``-q`` included) says what it had."""
    start, least = DISK_FREE
    terminalreporter.write_line(f"disk free: {start:.1f} GiB at the start, {least:.1f} GiB at the least")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``gpu`` tests skip where there is no CUDA GPU (``pytest -m gpu`` runs them on the GPU machine: docs/gpu.md)."""
    if item.get_closest_marker("gpu") is not None and not cuda_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False here (docs/gpu.md, pytest -m gpu)")


@pytest.fixture
def isolated_case(tmp_path):
    """``run(module, function, *args, device=..., timeout=...)``: ``module.function(*args)`` (a module of tests/,
    JSON-able arguments) in a ``python -X faulthandler`` child process of its own, whose returned dict comes back.

    A crash (the H200's AOTInductor loads segfault), a timeout or an exception in the child fails the test with
    the child's exit status and its last lines: it costs one case, not the run. The child runs in a scratch
    folder (never the source tree, so it imports the installed ``trtbuild``), with Triton compiling for the GPU
    on ``cuda`` and interpreting on ``cpu`` (``TRITON_INTERPRET``)."""
    from trtbuild.backends.torch.build.isolate import run_isolated

    def run(module: str, function: str, *args: object, device: str, timeout: float = 600.0) -> dict:
        code = (
            "import importlib, json, sys\n"
            "from trtbuild.backends.torch.build.isolate import report\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "fn = getattr(importlib.import_module(sys.argv[2]), sys.argv[3])\n"
            "report(fn(*json.loads(sys.argv[4])))\n"
        )
        args_json = json.dumps(list(args))
        env = {"TRITON_INTERPRET": "1" if device == "cpu" else "0"}
        done = run_isolated(
            code, args=[TESTS, module, function, args_json], timeout=timeout, env=env, cwd=str(tmp_path), tail=60
        )
        if not done.ok or not done.results:
            trace = "\n".join(done.trace)
            pytest.fail(f"{module}.{function}{tuple(args)} on {device}: {done.summary()}\n{trace}", pytrace=False)
        return done.results[-1]

    return run
