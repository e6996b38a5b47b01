"""Reproducible builds: the same checkpoint gives byte-identical engine directories (and the same checkpoint).

Checked in-process and across processes with different hash seeds and output paths, for every tiny architecture
and for float16 checkpoints; the pipeline gives the same digests in two fresh artifact directories.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_models import TINY_CONFIGS, make_hf_model

from trtbuild.artifacts.manifest import sha256_file
from trtbuild.build import build_engine
from trtbuild.config import BuildConfig, DType
from trtbuild.convert.convert import convert
from trtbuild.pipeline.plan import make_plan
from trtbuild.pipeline.runner import run_pipeline
from trtbuild.recipe import load_recipe

BUILD = BuildConfig(max_seq_len=64, kv_block_size=4)
CHILD = """
import sys
from pathlib import Path
from trtbuild.build import build_engine
from trtbuild.config import BuildConfig, DType
from trtbuild.convert.convert import convert
root, names = Path(sys.argv[1]), sys.argv[2:]
for name in names:
    convert(root / f"{name}-hf", root / f"{name}-ckpt-b", DType.FLOAT16 if name.endswith("fp16") else DType.FLOAT32)
    build_engine(root / f"{name}-ckpt-b", root / f"{name}-engine-b", BuildConfig(max_seq_len=64, kv_block_size=4))
"""


def tree(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file below ``root``."""
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repro")
    for name in TINY_CONFIGS:
        make_hf_model(name, root / f"{name}-hf")
    make_hf_model("llama_gqa", root / "llama_gqa-fp16-hf")
    (root / "llama_gqa-hf/tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return root


def test_same_checkpoint_gives_byte_identical_engines(sources):
    names = [*TINY_CONFIGS, "llama_gqa-fp16"]
    for name in names:
        dtype = DType.FLOAT16 if name.endswith("fp16") else DType.FLOAT32
        convert(sources / f"{name}-hf", sources / f"{name}-ckpt", dtype)
        build_engine(sources / f"{name}-ckpt", sources / f"{name}-engine", BUILD)
        build_engine(sources / f"{name}-ckpt", sources / f"{name}-engine-again", BUILD)  # same process, warm state
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, "-c", CHILD, str(sources), *names], check=True, env=env, cwd=sources)
    for name in names:
        engine = tree(sources / f"{name}-engine")
        assert {
            "manifest.json",
            "runtime_config.json",
            "engines/onnxruntime-cpu/model.onnx",
            "engines/onnxruntime-cpu/model.onnx.data",
        } <= set(engine)
        assert tree(sources / f"{name}-engine-again") == engine, name
        assert tree(sources / f"{name}-engine-b") == engine, name
        assert tree(sources / f"{name}-ckpt-b") == tree(sources / f"{name}-ckpt"), name
    assert "tokenizer_config.json" in tree(sources / "llama_gqa-engine")


def test_pipeline_digests_match_across_artifact_dirs(sources, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "r",
                "model": {"name": "m", "path": str(sources / "gpt2-hf")},
                "formats": [{"name": "fp32"}],
                "build": {"max_seq_len": 64},
            }
        )
    )
    plan = make_plan([load_recipe(recipe)])
    runs = [run_pipeline(plan, tmp_path / d, report=lambda _: None) for d in ("a", "b")]
    digests = [{sid: o.record["digest"] for sid, o in r.outcomes.items()} for r in runs]
    assert digests[0] == digests[1] and len(digests[0]) == 2
    assert tree(tmp_path / "a/m/fp32/onnxruntime/cpu") == tree(tmp_path / "b/m/fp32/onnxruntime/cpu")
