"""Recipes: the shipped ones load, bad ones fail with one line naming the key path, ``--recipe`` gives defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from tiny_models import make_hf_model

from trtbuild.cli import cli
from trtbuild.config import Backend, DType, QFormat, QuantConfig, TensorRTConfig
from trtbuild.configio import from_dict
from trtbuild.errors import ConfigError
from trtbuild.recipe import BuiltinModel, Recipe, load_recipe, recipe_quant_config, recipe_to_dict

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
TRTBUILD = [sys.executable, "-m", "trtbuild.cli"]
GOOD = {
    "name": "r",
    "model": {"name": "m", "path": "model-dir", "dtype": "float16"},
    "formats": [{"name": "fp32"}, {"name": "int8", "quantization": {"qformat": "int8_sq", "calib_size": 8}}],
    "targets": [{"backend": "onnxruntime"}, {"backend": "tensorrt", "arch": "sm90"}],
    "build": {"max_seq_len": 256, "kv_block_size": 8},
    "accuracy_gate": {"baseline": "fp32", "max_ppl_increase": 10.0, "eval": {"windows": 2}},
    "tensorrt": {"version_compatible": True},
}


def write(tmp_path: Path, data, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_shipped_recipes_load():
    names = sorted(p.name for p in RECIPES.glob("*.yaml"))
    assert {
        "template.yaml",
        "smollm2-fp32.yaml",
        "smollm2-int8_sq.yaml",
        "smollm2-int4_awq.yaml",
        "smollm2-fp8.yaml",
    } <= set(names)
    for path in RECIPES.glob("smollm2-*.yaml"):
        recipe = load_recipe(path)
        assert recipe.model.builtin is BuiltinModel.SMOLLM2 and recipe.formats[0].name == "fp32"
        assert recipe.targets[0].label == "onnxruntime/cpu"
        gate = recipe.accuracy_gate
        for fmt in recipe.formats[1:]:
            quant = fmt.quantization
            assert quant is not None and fmt.name.startswith(quant.qformat.value)
            assert gate is not None and gate.baseline == "fp32"
            assert gate.eval.dataset != quant.calib_dataset  # judged on another domain than the calibration's
            if "onnxruntime/cpu" in [t.label for t in recipe.targets_of(fmt)]:
                assert quant == QuantConfig(qformat=quant.qformat), f"{path.name} {fmt.name}: not the CLI defaults"
    int4 = load_recipe(RECIPES / "smollm2-int4_awq.yaml").format("int4_awq").quantization
    assert int4.group_size == 128  # the issue judges int4 at group 128 (SmolLM2's 576 in-features end half-full)
    template = load_recipe(RECIPES / "template.yaml")  # documents every key: each one is set there
    assert template.model.path == RECIPES / "../models/my-hf-folder"
    assert "backend" not in yaml.safe_load((RECIPES / "template.yaml").read_text())["build"]


def test_recipe_round_trips_and_resolves_relative_paths(tmp_path):
    (tmp_path / "calib.txt").write_text("text\n")
    recipe = load_recipe(write(tmp_path, _set(GOOD, "formats.1.quantization.calib_dataset", "calib.txt")))
    assert recipe.model.path == tmp_path / "model-dir" and recipe.model.dtype is DType.FLOAT16
    assert recipe.format("int8").quantization.calib_dataset == str(tmp_path / "calib.txt")  # a file: made absolute
    assert recipe.accuracy_gate.eval.dataset == "flask_docs"  # a dataset name stays a name
    assert recipe.tensorrt_for(recipe.targets[1]) == TensorRTConfig(arch=["sm90"], version_compatible=True)
    assert recipe.build.max_seq_len == 256 and recipe.build_for(recipe.targets[1]).backend is Backend.TENSORRT
    assert recipe.format("int8").quantization == QuantConfig(
        QFormat.INT8_SQ, calib_size=8, calib_dataset=str(tmp_path / "calib.txt")
    )
    assert from_dict(Recipe, recipe_to_dict(recipe), "recipe") == recipe
    assert recipe_quant_config(recipe, None).qformat is QFormat.INT8_SQ
    with pytest.raises(ConfigError, match="format 'fp32' has no quantization section"):
        recipe_quant_config(recipe, "fp32")


def _set(data: dict, dotted: str, value) -> dict:
    data = json.loads(json.dumps(data))
    *parents, last = dotted.split(".")
    node = data
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is KeyError:
        del node[last]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return data


BAD = {
    "wrong type": ("build.max_seq_len", "long", "recipe.build.max_seq_len: expected int, got str"),
    "unknown key": (
        "build.zzz",
        5,
        "recipe.build.zzz: unknown key (known: backend, cpu_attention, cpu_linear, kv_block_size, ",
    ),
    "misspelt key": ("build.max_seqlen", 5, "recipe.build.max_seqlen: unknown key (did you mean 'max_seq_len'?)"),
    "misspelt nested key": (
        "formats.1.quantization.calib_sise",
        4,
        "recipe.formats[1].quantization.calib_sise: unknown key (did you mean 'calib_size'?)",
    ),
    "misspelt enum": (
        "formats.1.quantization.qformat",
        "int8sq",
        "recipe.formats[1].quantization.qformat: 'int8sq' is not one of int8_sq, ",
    ),
    "misspelt baseline": ("accuracy_gate.baseline", "fp23", "recipe: accuracy_gate.baseline 'fp23' is not one of the"),
    "unknown nested key": ("formats.1.quantization.bits", 4, "recipe.formats[1].quantization.bits: unknown key"),
    "bad enum": (
        "formats.1.quantization.qformat",
        "int3",
        "recipe.formats[1].quantization.qformat: 'int3' is not one of",
    ),
    "missing key": ("model.name", KeyError, "recipe.model.name: missing key"),
    "bad value": ("build.kv_block_size", 0, "recipe.build: kv_block_size must be positive"),
    "backend in build": (
        "build.backend",
        "tensorrt",
        "recipe.build.backend: set backends per target under recipe.targets",
    ),
    "arch in tensorrt": (
        "tensorrt.arch",
        ["sm90"],
        "recipe.tensorrt.arch: set GPU archs per target under recipe.targets",
    ),
    "nested eval": ("accuracy_gate.eval.windows", 0, "recipe.accuracy_gate.eval: windows must be positive"),
    "path and builtin": ("model.builtin", "smollm2", "recipe.model: give exactly one of 'path' and 'builtin'"),
    "bad builtin": ("model.builtin", "gpt5", "recipe.model.builtin: 'gpt5' is not one of smollm2"),
    "ort arch": ("targets.0.arch", "sm90", "recipe.targets[0]: onnxruntime engines have arch 'cpu', not 'sm90'"),
    "gpu arch": ("targets.1.arch", "volta", "recipe.targets[1]: not a GPU arch: 'volta'"),
    "duplicate format": ("formats.1.name", "fp32", "recipe: format 'fp32' is listed twice"),
    "gate baseline": ("accuracy_gate.baseline", "fp16", "recipe: accuracy_gate.baseline 'fp16' is not one of the"),
    "format name": ("formats.0.name", "../x", "recipe.formats[0]: format name '../x' must be a plain name"),
    "list expected": ("formats", {"name": "fp32"}, "recipe.formats: expected a list, got dict"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_recipes_name_the_key_path(tmp_path, case):
    key, value, message = BAD[case]
    data = _set(GOOD, key, value)
    if case == "path and builtin":
        data["model"]["path"] = "x"
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_recipe(path)
    assert str(e.value).startswith(f"{path}: {message}"), str(e.value)
    assert "\n" not in str(e.value)
    suggestions = {"misspelt enum": "(did you mean 'int8_sq'?)", "misspelt baseline": "(did you mean 'fp32'?)"}
    assert str(e.value).endswith(suggestions.get(case, "")), str(e.value)


def run_cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([*TRTBUILD, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def test_recipe_errors_on_the_command_line_are_one_line(tmp_path):
    cases = [
        (write(tmp_path, _set(GOOD, "build.max_seq_len", "long")), "recipe.build.max_seq_len: expected int, got str"),
        (tmp_path / "missing.yaml", "missing.yaml: recipe file not found"),
        (write(tmp_path, "name: [unclosed\n", "syntax.yaml"), "syntax.yaml: not valid YAML at line 2"),
        (write(tmp_path, "- a list\n", "list.yaml"), "recipe: expected a mapping, got list"),
        (
            write(tmp_path, _set(GOOD, "build.max_batch_sise", 4), "typo.yaml"),
            "recipe.build.max_batch_sise: unknown key (did you mean 'max_batch_size'?)",
        ),
    ]
    for path, needle in cases:
        commands = [["pipeline", path, "-o", tmp_path / "art"]]
        if path == cases[0][0]:  # the --recipe flag reads recipes the same way
            commands.append(["build", tmp_path / "ckpt", "--recipe", path, "-o", tmp_path / "e"])
        for args in commands:
            proc = run_cli(*args)
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
            assert needle in lines[0], lines[0]
    assert not (tmp_path / "art").exists() and not (tmp_path / "e").exists()


def test_recipe_values_are_defaults_and_flags_override(tmp_path):
    make_hf_model("llama_gqa", tmp_path / "hf")
    recipe = write(
        tmp_path,
        {
            "name": "r",
            "model": {"name": "m", "path": "hf", "dtype": "float16"},
            "formats": [{"name": "fp16"}],
            "build": {"max_seq_len": 64, "kv_block_size": 4},
        },
    )
    runner = CliRunner()
    res = runner.invoke(cli, ["convert", "--recipe", str(recipe), "-o", str(tmp_path / "ckpt")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "ckpt/config.json").read_text())["dtype"] == "float16"  # source + dtype: recipe
    res = runner.invoke(
        cli,
        [
            "convert",
            str(tmp_path / "hf"),
            "--recipe",
            str(recipe),
            "--dtype",
            "float32",
            "-o",
            str(tmp_path / "ckpt32"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "ckpt32/config.json").read_text())["dtype"] == "float32"  # the flag wins
    res = runner.invoke(
        cli,
        [
            "build",
            str(tmp_path / "ckpt"),
            "--recipe",
            str(recipe),
            "--kv-block-size",
            "8",
            "-o",
            str(tmp_path / "engine"),
        ],
    )
    assert res.exit_code == 0, res.output
    build = json.loads((tmp_path / "engine/runtime_config.json").read_text())["build"]
    assert (build["max_seq_len"], build["kv_block_size"], build["max_batch_size"]) == (64, 8, 64)
    res = runner.invoke(cli, ["build", str(tmp_path / "ckpt"), "-o", str(tmp_path / "plain")])
    assert json.loads((tmp_path / "plain/runtime_config.json").read_text())["build"]["max_seq_len"] == 128  # model max
