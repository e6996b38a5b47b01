"""Bad input to ``trtbuild quantize``: one clear error line, exit status 2, nothing written."""

from __future__ import annotations

import json

import pytest
from quantize_helpers import calib_file, tiny_checkpoint
from safetensors import safe_open
from test_cli_errors import assert_clean_failure, run_cli


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("qerr")
    _, llama = tiny_checkpoint(root, "llama_gqa")
    _, gpt2 = tiny_checkpoint(root, "gpt2")
    (root / "empty.txt").write_text("\n\n  \n")
    (root / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "no text key"}\n')
    return {
        "llama": llama,
        "gpt2": gpt2,
        "calib": calib_file(root),
        "empty": root / "empty.txt",
        "bad_jsonl": root / "bad.jsonl",
        "missing": root / "missing.txt",
    }


CASES = {
    "unknown qformat": (["--qformat", "int3"], "'int3' is not one of int8_sq, fp8, int8_wo, int4_wo, int4_awq"),
    "group size": (
        ["--qformat", "int4_awq", "--group-size", "48"],
        "--group-size 48 is not a power of two >= 16",
    ),
    "empty calibration file": (["--qformat", "int8_sq", "--calib-dataset", "{empty}"], "no text in the calibration"),
    "missing calibration file": (["--qformat", "int8_sq", "--calib-dataset", "{missing}"], "no such dataset file"),
    "bad jsonl": (["--qformat", "int8_sq", "--calib-dataset", "{bad_jsonl}"], "bad.jsonl:2: expected an object with"),
    "architecture": (["--qformat", "fp8", "--src", "gpt2"], "architecture GPT2LMHeadModel is not supported"),
    "nothing left": (["--qformat", "int8_wo", "--exclude", "*"], "leaves no linear layer to quantize"),
    "bad size": (["--qformat", "int8_wo", "--calib-size", "0"], "calib_size must be positive"),
    "zero points": (["--qformat", "int8_wo", "--zero-points"], "zero_points applies to the int4 formats only"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantize_rejects(sources, tmp_path, case):
    args, needle = CASES[case]
    args = [a.format(**{k: str(v) for k, v in sources.items()}) for a in args]
    src = sources["llama"]
    if "--src" in args:
        i = args.index("--src")
        src = sources[args[i + 1]]
        del args[i : i + 2]
    if "--calib-dataset" not in args:
        args += ["--calib-dataset", str(sources["calib"])]
    out = tmp_path / "q"
    assert_clean_failure(run_cli("quantize", src, "-o", out, *args), needle)
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary directory


def test_quantize_refuses_quantized_source_and_existing_output(sources, tmp_path):
    out = tmp_path / "q"
    args = ["--qformat", "int8_wo", "--calib-dataset", sources["calib"], "--calib-size", "1", "--calib-seq-len", "8"]
    proc = run_cli("quantize", sources["llama"], "-o", out, *args, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text())["quantization"]["qformat"] == "int8_wo"
    assert_clean_failure(run_cli("quantize", out, "-o", tmp_path / "q2", *args), "already quantized")
    assert_clean_failure(run_cli("quantize", sources["llama"], "-o", out, *args), "already exists")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_int4_prints_what_it_costs_and_the_lm_head_is_quantized_by_default(sources, tmp_path):
    """int4 says what it measured on SmolLM2 and how to measure this model; other formats print no such note.
    With no --exclude every linear is quantized, the LM head int8 weight-only; --exclude lm_head keeps it float."""
    proc = run_cli("quantize", sources["llama"], "-o", tmp_path / "q4", "--qformat", "int4_wo", "--group-size", "16")
    assert proc.returncode == 0, proc.stderr
    note = [ln for ln in proc.stderr.splitlines() if ln.startswith("note: int4 costs accuracy")]
    assert len(note) == 1 and "+68.0%" in note[0] and "--zero-points costs less" in note[0], proc.stderr
    assert f"trtbuild build {tmp_path / 'q4'} -o ENGINE && trtbuild eval ENGINE" in note[0]
    assert json.loads((tmp_path / "q4/config.json").read_text())["quantization"]["exclude"] == []
    with safe_open(str(tmp_path / "q4/rank0.safetensors"), framework="pt") as f:
        assert str(f.get_slice("lm_head.weight").get_dtype()) == "I8" and "lm_head.weight_scale" in f.keys()  # noqa: SIM118
    proc = run_cli("quantize", sources["llama"], "-o", tmp_path / "q8", "--qformat", "int8_wo", "--exclude", "lm_head")
    assert proc.returncode == 0 and "note:" not in proc.stderr, proc.stderr
    with safe_open(str(tmp_path / "q8/rank0.safetensors"), framework="pt") as f:
        assert str(f.get_slice("lm_head.weight").get_dtype()) == "F32"


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("mistral", dict(sliding_window=6)),
        ("qwen3", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
        ("phi3", dict(sliding_window=6)),
    ],
)
def test_quantize_rebuilds_windowed_models(tmp_path, name, overrides):
    """Sliding windows survive quantize's round trip through transformers: the config it writes reads back to the
    checkpoint's, and the rebuilt model computes the original's logits past the window."""
    import numpy as np
    import torch
    from tiny_models import make_hf_model

    from trtbuild.checkpoint.files import load_checkpoint
    from trtbuild.config import DType
    from trtbuild.convert.convert import convert
    from trtbuild.models import model_config_from_hf
    from trtbuild.quantize.hf_config import hf_config
    from trtbuild.quantize.hf_model import build_hf_model

    model = make_hf_model(name, tmp_path / "hf", **overrides)
    convert(tmp_path / "hf", tmp_path / "ckpt", DType.FLOAT32)
    cfg, weights = load_checkpoint(tmp_path / "ckpt")
    assert cfg.sliding_window == 6 and model_config_from_hf(hf_config(cfg), DType.FLOAT32) == cfg
    ids = torch.tensor([[int(t) for t in np.random.default_rng(0).integers(0, 80, 17)]])
    with torch.no_grad():
        torch.testing.assert_close(build_hf_model(cfg, weights)(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
