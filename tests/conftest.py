"""Shared fixtures: the tiny models of tiny_models.py, converted and built once per session."""

from __future__ import annotations

import os

# Triton reads this at its first import: the plugin kernels' tests run in its CPU interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

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
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model, tok, root / "engine"
