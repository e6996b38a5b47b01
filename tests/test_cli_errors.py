"""Bad input to convert/build: one clear error line, non-zero exit, no output directory left behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from tiny_models import make_hf_model

ROOT = Path(__file__).resolve().parents[1]
TRTBUILD = [sys.executable, "-m", "trtbuild.cli"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([*TRTBUILD, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def assert_clean_failure(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bad") / "llama"
    make_hf_model("llama_gqa", folder)
    return folder


def variant(src: Path, dst: Path, *, config=None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(str(dst / "model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _extra(t):
    t["model.layers.0.self_attn.rogue_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"].clone()


CASES = {
    "unconsumed": (dict(tensors=_extra), "model.layers.0.self_attn.rogue_proj.weight is not consumed"),
    "missing": (
        dict(tensors=lambda t: t.pop("model.layers.1.mlp.down_proj.weight")),
        "missing tensor layers.1.mlp.down",
    ),
    "unsupported": (dict(config=lambda c: c.update(architectures=["FooForCausalLM"])), "supported: GPT2LMHeadModel"),
    "inconsistent": (dict(config=lambda c: c.update(num_key_value_heads=3)), "not a multiple of num_kv_heads"),
    "shape": (dict(config=lambda c: c.update(intermediate_size=100)), "config implies"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_convert_rejects(hf_llama, tmp_path, case):
    kwargs, needle = CASES[case]
    src = variant(hf_llama, tmp_path / "src", **kwargs)
    out = tmp_path / "ckpt"
    assert_clean_failure(run_cli("convert", src, "-o", out), needle)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no temporary directory left either


def test_convert_rejects_missing_and_foreign_sources(tmp_path):
    assert_clean_failure(run_cli("convert", tmp_path / "nope", "-o", tmp_path / "o"), "no such file")
    (tmp_path / "x.bin").write_bytes(b"\0" * 16)
    assert_clean_failure(run_cli("convert", tmp_path / "x.bin", "-o", tmp_path / "o"), "expected a .gguf file")
    (tmp_path / "fake.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    assert_clean_failure(run_cli("convert", tmp_path / "fake.gguf", "-o", tmp_path / "o"), "not a readable GGUF")
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "pickle" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    assert_clean_failure(run_cli("convert", tmp_path / "pickle", "-o", tmp_path / "o"), "pickle weights are not loaded")
    assert not (tmp_path / "o").exists()


def test_build_rejects_bad_checkpoints(hf_llama, tmp_path):
    assert_clean_failure(run_cli("build", tmp_path / "none", "-o", tmp_path / "e"), "no such checkpoint")
    ckpt = tmp_path / "ckpt"
    assert run_cli("convert", hf_llama, "-o", ckpt).returncode == 0
    assert_clean_failure(run_cli("convert", hf_llama, "-o", ckpt), "already exists")
    assert_clean_failure(
        run_cli("build", ckpt, "-o", tmp_path / "e", "--max-seq-len", "0"), "max_seq_len must be positive"
    )
    (ckpt / "rank0.safetensors").write_bytes(b"garbage")
    assert_clean_failure(run_cli("build", ckpt, "-o", tmp_path / "e"), "unreadable")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_layers"] = "two"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_clean_failure(run_cli("build", ckpt, "-o", tmp_path / "e"), "num_layers: expected int")
    assert not (tmp_path / "e").exists()


def test_tensorrt_backend_without_tensorrt_fails_cleanly(hf_llama, tmp_path):
    pytest.importorskip("onnx")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    ckpt = tmp_path / "ckpt"
    assert run_cli("convert", hf_llama, "-o", ckpt).returncode == 0
    proc = run_cli("build", ckpt, "-o", tmp_path / "e", "--backend", "tensorrt", "--arch", "sm90")
    assert_clean_failure(proc, "TensorRT is not installed: pip install 'trtbuild[tensorrt]'")
    proc = run_cli("build", ckpt, "-o", tmp_path / "e", "--arch", "sm90")
    assert_clean_failure(proc, "need --backend tensorrt")
    assert not (tmp_path / "e").exists()


def test_outputs_under_a_missing_directory_are_refused(hf_llama, tiny_engines, tmp_path):
    """Every output option (files and checkpoint / engine / artifacts directories) refuses a path whose parent
    directory does not exist, with one line, and creates nothing; the output itself is created as before."""
    from test_llm import add_tokenizer

    ckpt, engine = tiny_engines["llama_gqa"][1:]
    missing = tmp_path / "typo" / "dir"
    commands = [
        ["convert", hf_llama, "-o", missing / "ckpt"],
        ["quantize", ckpt, "--qformat", "int8_wo", "-o", missing / "q"],
        ["build", ckpt, "-o", missing / "engine"],
        ["pipeline", ROOT / "recipes" / "smollm2-fp32.yaml", "-o", missing / "artifacts"],
        ["run", engine, "--prompt", "x", "--output", missing / "out.jsonl"],
    ]
    for args in commands:
        needle = f"--output {args[-1]}: the directory {missing} does not exist (create it first)"
        assert_clean_failure(run_cli(*args), needle)
        assert not (tmp_path / "typo").exists(), args[0]
    (tmp_path / "file").write_text("x")
    proc = run_cli("run", engine, "--prompt", "x", "--output", tmp_path / "file" / "out.jsonl")
    assert_clean_failure(proc, f"the directory {tmp_path / 'file'} is not a directory")
    text = add_tokenizer(engine, tmp_path / "text")
    proc = run_cli("run", text, "--prompt", "x", "--output", tmp_path, "--overwrite")
    assert_clean_failure(proc, f"--output {tmp_path}: a directory (expected a file name)")
    (tmp_path / "typo").mkdir()
    assert run_cli("build", ckpt, "-o", tmp_path / "typo" / "engine").returncode == 0  # the leaf is created


def test_a_file_where_a_directory_belongs_says_what_it_is(tiny_engines, tmp_path):
    """inspect / build / run / eval / verify given an existing file: one line naming what the file is and what was
    expected, not "no such directory"."""
    ckpt, engine = tiny_engines["llama_gqa"][1:]
    weights = ckpt / "rank0.safetensors"
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("x")
    cases = [
        (["inspect", weights], f"{weights}: a safetensors file, not a checkpoint or engine directory"),
        (["build", weights, "-o", tmp_path / "e"], f"{weights}: a safetensors file, not a checkpoint directory"),
        (["run", tmp_path / "notes.txt", "--prompt", "x"], "notes.txt: a file, not an engine directory"),
        (["eval", weights], "a safetensors file, not an engine or checkpoint directory"),
        # (inspect takes a .gguf file: tests/test_inspect_support.py)
        (["build", tmp_path / "model.gguf", "-o", tmp_path / "e"], "a GGUF file, not a checkpoint directory (make a"),
    ]
    for args, needle in cases:
        assert_clean_failure(run_cli(*args), needle)
    proc = run_cli("verify", engine / "manifest.json")
    assert proc.returncode != 0 and "a JSON file, not an engine directory" in proc.stdout + proc.stderr
    assert_clean_failure(run_cli("inspect", tmp_path / "nope"), "nope: no such file or directory")
