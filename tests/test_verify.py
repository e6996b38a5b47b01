"""``trtbuild verify`` catches every flipped byte, missing/extra file and version/target mismatch; ``inspect``."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tiny_models import make_hf_model

from trtbuild.artifacts.engine_select import local_compute_capability
from trtbuild.artifacts.inspect import inspect_path, render_text
from trtbuild.artifacts.manifest import cpu_target, manifest_digest, package_versions
from trtbuild.artifacts.torch_select import TorchFacts
from trtbuild.artifacts.verify import LocalVersions, verify_artifacts, verify_engine_dir
from trtbuild.errors import TrtbuildError
from trtbuild.pipeline.plan import make_plan
from trtbuild.pipeline.runner import run_pipeline
from trtbuild.recipe import load_recipe

TRTBUILD = [sys.executable, "-m", "trtbuild.cli"]
ENGINE = "tiny/fp32/onnxruntime/cpu"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verify")
    make_hf_model("qwen2_bias", root / "hf")
    (root / "hf/tokenizer_config.json").write_text('{"model_max_length": 128}\n')  # copied along to the engine
    recipe = root / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "r",
                "model": {"name": "tiny", "path": "hf"},
                "formats": [{"name": "fp32"}],
                "build": {"max_seq_len": 64, "kv_block_size": 4},
            }
        )
    )
    run_pipeline(make_plan([load_recipe(recipe)]), root / "art", report=lambda _: None)
    return root / "art"


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def resign(engine: Path, manifest: dict) -> None:
    """Write ``manifest`` with a matching digest: what another trtbuild build would have written."""
    manifest["digest"] = manifest_digest(manifest)
    (engine / "manifest.json").write_text(json.dumps(manifest))


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_intact_artifacts_verify(artifacts):
    assert verify_artifacts(artifacts).ok
    report = verify_engine_dir(artifacts / ENGINE)
    # model.onnx, its data, native_weights.json, runtime_config.json, the tokenizer; built here: no version notes
    assert report.ok and report.checked_files == 6 and report.notes == []
    proc = subprocess.run([*TRTBUILD, "verify", str(artifacts / ENGINE)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("ok: "), proc.stderr


def _all_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_flipped_byte_in_any_artifact_file_is_caught(artifacts, tmp_path, where):
    art = copy(artifacts, tmp_path / "art")
    files = [f for f in _all_files(art) if not f.startswith(".pipeline/") and f != "index.json"]
    assert {f"{ENGINE}/manifest.json", "tiny/checkpoint/rank0.safetensors", f"{ENGINE}/tokenizer_config.json"} <= set(
        files
    )
    for rel in files:
        path = art / rel
        original = path.read_bytes()
        flip(path, {"start": 0, "middle": len(original) // 2, "end": -1}[where])
        report = verify_artifacts(art)
        assert not report.ok, rel
        assert any(str(path) in p or "manifest.json" in p for p in report.problems), (rel, report.problems)
        if rel.startswith(ENGINE):  # the engine directory alone catches it too (manifest.json by its digest)
            assert not verify_engine_dir(art / ENGINE, use_index=False).ok, rel
        path.write_bytes(original)
    assert verify_artifacts(art).ok


def test_missing_extra_and_incomplete_files(artifacts, tmp_path):
    engine = copy(artifacts / ENGINE, tmp_path / "engine")  # outside any index: the manifest alone
    (engine / "engines/onnxruntime-cpu/model.onnx.data").unlink()
    (engine / "notes.txt").write_text("x")
    problems = verify_engine_dir(engine).problems
    assert len(problems) == 2, problems
    assert problems[0].endswith("model.onnx.data: missing") and "notes.txt: unexpected file" in problems[1]
    (engine / "manifest.json").unlink()  # what a killed build leaves: files without a manifest
    assert "(an incomplete or interrupted build" in verify_engine_dir(engine).problems[0]
    assert "no such engine directory" in verify_engine_dir(tmp_path / "nope").problems[0]
    proc = subprocess.run([*TRTBUILD, "verify", str(engine)], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.splitlines()[0].startswith("problem: ")


def test_version_and_target_mismatches(artifacts, tmp_path):
    engine = copy(artifacts / ENGINE, tmp_path / "engine")
    here = LocalVersions.detect()
    ort = here.packages["onnxruntime"]
    major, minor, *_ = ort.split(".")
    newer = LocalVersions({**here.packages, "onnxruntime": f"{major}.{int(minor) + 1}.0"}, here.cpu_target)
    (problem,) = verify_engine_dir(engine, newer).problems
    assert problem == f"onnxruntime {major}.{int(minor) + 1}.0 here, engine built with {ort} (major.minor must match)"
    patch = LocalVersions({**here.packages, "onnxruntime": f"{major}.{minor}.99", "torch": "9.9"}, here.cpu_target)
    report = verify_engine_dir(engine, patch)
    assert report.ok and report.notes == [f"torch 9.9 here, {here.packages['torch']} at build time"]
    other = LocalVersions(here.packages, "cpu-aarch64-darwin")
    assert verify_engine_dir(engine, other).problems == [
        f"built for {cpu_target()}, this machine is cpu-aarch64-darwin"
    ]

    manifest = json.loads((engine / "manifest.json").read_text())  # and through the CLI, with this machine's facts
    manifest["versions"]["onnxruntime"] = "1.0.0"
    resign(engine, manifest)
    proc = subprocess.run([*TRTBUILD, "verify", str(engine)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert (
        proc.stderr.splitlines()[0]
        == f"problem: onnxruntime {ort} here, engine built with 1.0.0 (major.minor must match)"
    )


@pytest.mark.skipif(local_compute_capability() is not None, reason="checks the message of a machine without a GPU")
def test_tensorrt_engines_are_checked_against_this_machine(artifacts, tmp_path):
    engine = copy(artifacts / ENGINE, tmp_path / "engine")
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["engines"] = [
        {
            "backend": "tensorrt",
            "target": "sm90",
            "path": "engines/tensorrt-sm90/engine.plan",
            "tensorrt_version": "10.9.0",
            "plugin_version": "1",
        }
    ]
    resign(engine, manifest)
    problems = verify_engine_dir(engine).problems
    assert problems == ["tensorrt sm90, TensorRT 10.9.0, plugin 1: needs an NVIDIA GPU, this machine has none"]


def torch_entry(target: str, runtime: str, torch_version: str = "1.0.0") -> dict:
    return {
        "backend": "torch",
        "target": target,
        "path": f"engines/torch-{target}/model.pt2",
        "torch_version": torch_version,
        "torch_runtime": runtime,
    }


def test_torch_engines_are_checked_against_this_machine(artifacts, tmp_path):
    """As opening the engine does: an AOTInductor package needs its target and torch major.minor, a torch-compile
    engine its device type; each refused engine is one line with every reason, and one engine that runs suffices."""
    engine = copy(artifacts / ENGINE, tmp_path / "engine")
    manifest = json.loads((engine / "manifest.json").read_text())
    here = LocalVersions.detect()
    facts = here.torch_facts()
    assert facts.torch_version == torch.__version__ and facts.cpu_target.startswith("cpu-")

    def problems(*entries: dict, local: LocalVersions = here) -> list[str]:
        resign(engine, {**manifest, "engines": list(entries)})
        return verify_engine_dir(engine, local).problems

    package = torch_entry("cpu-sse9", "aot-inductor")
    assert problems(package) == [
        f"torch cpu-sse9 (aot-inductor), torch 1.0.0: built for cpu-sse9, this machine is {facts.cpu_target}; "
        f"built with torch 1.0.0, installed is {torch.__version__}"
    ]
    assert problems(package, torch_entry("compile-cpu", "torch-compile")) == []
    assert problems(torch_entry(facts.cpu_target, "aot-inductor", torch.__version__.split("+")[0])) == []
    without_torch = dataclasses.replace(here, torch=TorchFacts(None, None, None))
    assert problems(torch_entry("compile-cpu", "torch-compile"), local=without_torch) == [
        "torch compile-cpu (torch-compile), torch 1.0.0: torch is not installed on this machine"
    ]
    without_gpu = dataclasses.replace(here, torch=dataclasses.replace(facts, cuda_target=None))
    resign(engine, {**manifest, "engines": [torch_entry("compile-cuda", "torch-compile")]})
    report = verify_engine_dir(engine, without_gpu)  # a GPU engine on the CPU host that built it: a note
    assert report.ok and report.notes[0] == (
        "torch compile-cuda (torch-compile), torch 1.0.0: this machine has no NVIDIA GPU (checked again when opened "
        "on a GPU machine)"
    )
    assert problems(torch_entry("cuda-sm90", "aot-inductor"), package, local=without_gpu) == [
        "torch cuda-sm90 (aot-inductor), torch 1.0.0: this machine has no NVIDIA GPU",
        f"torch cpu-sse9 (aot-inductor), torch 1.0.0: built for cpu-sse9, this machine is {facts.cpu_target}; "
        f"built with torch 1.0.0, installed is {torch.__version__}",
    ]
    with_gpu = dataclasses.replace(here, torch=dataclasses.replace(facts, cuda_target="cuda-sm90"))
    assert problems(torch_entry("cuda-sm80", "aot-inductor", torch.__version__), local=with_gpu) == [
        f"torch cuda-sm80 (aot-inductor), torch {torch.__version__}: built for cuda-sm80, this machine is cuda-sm90"
    ]

    resign(engine, {**manifest, "engines": [package]})  # and through the CLI, with this machine's facts
    proc = subprocess.run([*TRTBUILD, "verify", str(engine)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[0].startswith("problem: torch cpu-sse9 (aot-inductor), torch 1.0.0: built for")


def test_inspect_checkpoint_and_engine(artifacts):
    ckpt = inspect_path(artifacts / "tiny/checkpoint")
    assert ckpt["kind"] == "checkpoint" and ckpt["config"]["architecture"] == "Qwen2ForCausalLM"
    assert ckpt["quantization"] is None
    tensors = {t["name"]: t for t in ckpt["tensors"]}
    assert tensors["layers.0.attn.qkv.bias"] == {
        "name": "layers.0.attn.qkv.bias",
        "dtype": "F32",
        "shape": [80],
        "bytes": 320,
    }
    assert sum(ckpt["files"].values()) == sum(f.stat().st_size for f in (artifacts / "tiny/checkpoint").iterdir())

    eng = inspect_path(artifacts / ENGINE)
    assert (eng["kind"], eng["backend"], eng["target"]) == ("engine", "onnxruntime", cpu_target())
    assert eng["portable_op_counts"]["trtbuild::PagedAttention"] == 2 and eng["op_counts"]["MatMul"] > 0
    assert eng["versions"]["onnxruntime"] == package_versions()["onnxruntime"]
    assert eng["build_options"]["max_seq_len"] == 64 and "manifest.json" in eng["files"]
    assert any(t["name"] == "embed.weight" and t["shape"] == [101, 48] for t in eng["tensors"])
    text = render_text(eng)
    assert "trtbuild::PagedAttention" in text and "embed.weight" in text and "quantization: none" in text

    proc = subprocess.run([*TRTBUILD, "inspect", str(artifacts / ENGINE), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0 and json.loads(proc.stdout)["manifest"]["backend"] == "onnxruntime"
    with pytest.raises(TrtbuildError, match="neither a checkpoint"):
        inspect_path(artifacts / "tiny")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([*TRTBUILD, "inspect", str(artifacts / "nope")], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "no such file or directory" in proc.stderr


def test_inspect_refuses_a_truncated_or_padded_safetensors_file(tiny_engines, tmp_path):
    """The header's data offsets must cover the file's data exactly: a cut file (an interrupted copy) is one error
    line and exit 2, not a tensor table as if it were whole."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    ckpt = copy(tiny_engines["llama_gqa"][1], tmp_path / "ckpt")
    weights = ckpt / "rank0.safetensors"
    whole = weights.read_bytes()
    assert inspect_path(ckpt)["tensors"]
    weights.write_bytes(whole[:-100])
    proc = subprocess.run([*TRTBUILD, "inspect", str(ckpt)], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    data = len(whole) - 8 - int.from_bytes(whole[:8], "little")
    needle = f"truncated: its header describes {data} bytes of tensor data, the file holds {data - 100}"
    assert proc.stderr.splitlines() == [f"error: {weights}: {needle} (an interrupted copy or download?)"]
    weights.write_bytes(whole[:20])  # cut inside the header
    with pytest.raises(TrtbuildError, match=r"not a readable safetensors file \(the file ends inside its"):
        inspect_path(ckpt)
    weights.write_bytes(whole + b"\0" * 8)
    with pytest.raises(TrtbuildError, match="8 bytes after the last tensor"):
        inspect_path(ckpt)


def test_inspect_lists_layers_in_numeric_order(tmp_path):
    """layers.2 before layers.10, in the tensor table (text and --json) and the file list."""
    import numpy as np
    from safetensors.numpy import save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    names = [f"layers.{i}.mlp.down.weight" for i in (10, 2, 1, 11, 0)] + ["embed.weight", "lm_head.weight"]
    save_file({n: np.zeros((2, 2), np.float32) for n in names}, str(ckpt / "rank0.safetensors"))
    for i in (10, 9):
        (ckpt / f"notes{i}.txt").write_text("x")
    expected = ["embed.weight", *(f"layers.{i}.mlp.down.weight" for i in (0, 1, 2, 10, 11)), "lm_head.weight"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([*TRTBUILD, "inspect", str(ckpt), "--json"], capture_output=True, text=True, env=env)
    info = json.loads(proc.stdout)
    assert [t["name"] for t in info["tensors"]] == expected
    assert list(info["files"]) == ["config.json", "notes9.txt", "notes10.txt", "rank0.safetensors"]
    text = subprocess.run([*TRTBUILD, "inspect", str(ckpt)], capture_output=True, text=True, env=env).stdout
    assert [line.split()[0] for line in text.splitlines() if ".weight" in line] == expected
