"""``trtbuild bench --profile``: the time breakdown adds up, and onnxruntime's kernels are sorted by kind."""

from __future__ import annotations

import json

import pytest

from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.cli import main
from trtbuild.config import ORT_LOWERED_NODE_PREFIX
from trtbuild.runtime.profile import KERNEL_KINDS, kernel_kind


def test_kernel_kinds():
    assert kernel_kind("MatMulNBits", "layers.3.attn.qkv_MatMulNBits") == "matmul"
    assert kernel_kind("QuantizeRows", "layers.3.mlp.down.int8.quantize") == "matmul"  # per-token int8's ends
    assert kernel_kind("Gather", ORT_LOWERED_NODE_PREFIX + "layers.3.attn.paged.k_gather") == "attention"
    assert kernel_kind("MatMul", ORT_LOWERED_NODE_PREFIX + "layers.3.attn.paged.x") == "attention"
    assert kernel_kind("SkipSimplifiedLayerNormalization", "layers.3.post_attn_norm") == "norm"
    assert kernel_kind("Gather", "embed") == "other"


def test_session_kernel_times_need_profiling(tiny_engines):
    from trtbuild.errors import EngineError

    with pytest.raises(EngineError, match="profile_kernels"):
        OrtSession(tiny_engines["llama_gqa"][2], kv_cache_memory=1 << 20).kernel_times()


def test_bench_profile_adds_up(monkeypatch, capsys, tiny_engines):
    engine = tiny_engines["llama_gqa"][2]
    args = ["bench", str(engine), "--num-requests", "3", "--input-len", "9", "--output-len", "5"]
    monkeypatch.setattr("sys.argv", ["trtbuild", *args, "--profile", "--json"])
    main()
    result = json.loads(capsys.readouterr().out)
    parts = result["profile"]
    assert all(v >= 0 for v in parts.values())
    for kind in KERNEL_KINDS:
        assert f"onnxruntime kernels: {kind}" in parts
    assert parts["onnxruntime kernels: matmul"] > 0 and parts["onnxruntime kernels: attention"] > 0
    # the parts are disjoint pieces of the measured wall time (rounded to 0.1 ms each)
    assert sum(parts.values()) == pytest.approx(result["duration_s"], abs=2e-3 * len(parts))

    monkeypatch.setattr("sys.argv", ["trtbuild", *args, "--profile"])
    main()
    table = capsys.readouterr().out
    assert "where the time goes" in table and "onnxruntime kernels: attention" in table
