"""Shared fixtures: the tiny models of tiny_models.py, converted and built once per session."""

from __future__ import annotations

import pytest
from tiny_models import TINY_CONFIGS, make_hf_model


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
