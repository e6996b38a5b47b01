"""Engine selection (pure Python) and the TensorRT backend's behaviour without TensorRT."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from trtbuild.artifacts.engine_select import (
    EngineEntry,
    LocalFacts,
    detect_local_facts,
    entries_from_manifest,
    parse_arch,
    select_engine,
)
from trtbuild.artifacts.ptx import driver_cuda_version, max_ptx_for_cuda, ptx_cap, ptx_number
from trtbuild.backends.tensorrt.build.engines import build_tensorrt_engines, resolve_archs
from trtbuild.config import BuildConfig
from trtbuild.errors import BuildError, EngineError
from trtbuild.plugins.paged_attention import tensorrt_plugin

TRT = "10.9.0.34"
PLUGIN = "1.0.0"


def trt_entry(target: str, **kw: object) -> EngineEntry:
    fields: dict = dict(
        backend="tensorrt",
        target=target,
        path=f"engines/tensorrt-{target}/engine.plan",
        tensorrt_version=TRT,
        compute_capability=f"{target[2:-1]}.{target[-1]}",
        plugin_version=PLUGIN,
    )
    fields.update(kw)
    return EngineEntry(**fields)


def manifest(*entries: EngineEntry) -> dict:
    return {"manifest_version": 1, "engines": [e.to_dict() for e in entries]}


def local(cc: tuple[int, int] | None = (9, 0), trt: str | None = TRT, plugin: str = PLUGIN) -> LocalFacts:
    return LocalFacts(cc, trt, plugin)


def test_matching_engine_is_selected() -> None:
    m = manifest(trt_entry("sm80"), trt_entry("sm90"), EngineEntry("onnxruntime", "cpu-x86_64-linux", "m.onnx"))
    assert select_engine(m, local((9, 0))).target == "sm90"
    assert select_engine(m, local((8, 0))).target == "sm80"
    assert select_engine(m, local(None), backend="onnxruntime").backend == "onnxruntime"


def test_mismatched_arch_names_engines_and_the_command() -> None:
    m = manifest(trt_entry("sm80"), trt_entry("sm90"))
    with pytest.raises(EngineError) as e:
        select_engine(m, local((8, 9)), engine_dir="out/engine", checkpoint="ckpt")
    msg = str(e.value)
    assert "\n" not in msg
    assert "needed: sm89" in msg
    assert "built for sm80, this GPU is sm89" in msg and "built for sm90, this GPU is sm89" in msg
    assert "trtbuild build ckpt -o out/engine --backend tensorrt --arch sm89" in msg
    assert "--hardware-compatibility ampere+" in msg  # the portable alternative, since sm89 >= sm80


def test_mismatched_tensorrt_version() -> None:
    m = manifest(trt_entry("sm90"))
    with pytest.raises(EngineError) as e:
        select_engine(m, local(trt="10.11.0.33"))
    msg = str(e.value)
    assert f"built with TensorRT {TRT}, installed is 10.11.0.33" in msg
    assert "--backend tensorrt --arch sm90" in msg
    assert f"pip install tensorrt=={TRT}" in msg  # or go back to the TensorRT that built it
    with pytest.raises(EngineError, match=r"built with TensorRT 10\.9\.0\.34, installed is 10\.9\.0\.40"):
        select_engine(m, local(trt="10.9.0.40"))  # another build of the same release: not the same TensorRT


def test_version_compatible_engines_run_on_later_tensorrt_of_the_same_major() -> None:
    m = manifest(trt_entry("sm90", version_compatible=True))
    assert select_engine(m, local(trt="10.11.0.33")).version_compatible
    for newer_major_or_older in ("11.0.0.1", "10.8.0.43"):
        with pytest.raises(EngineError, match=r"version-compatible: runs on 10\.x >= 10\.9\.0\.34"):
            select_engine(m, local(trt=newer_major_or_older))


def test_mismatched_plugin_version() -> None:
    m = manifest(trt_entry("sm90"))
    with pytest.raises(EngineError) as e:
        select_engine(m, local(plugin="2.0.0"))
    assert "built with plugin 1.0.0, this trtbuild has plugin 2.0.0" in str(e.value)
    assert "--backend tensorrt --arch sm90" in str(e.value)
    assert "pip install tensorrt" not in str(e.value)  # a TensorRT install would not help


def test_ampere_plus_portability() -> None:
    portable = trt_entry("sm80", hardware_compatibility="ampere+")
    m = manifest(portable, trt_entry("sm90"))
    assert select_engine(m, local((8, 9))) == portable  # any GPU from sm80
    assert select_engine(m, local((12, 0))) == portable
    assert select_engine(m, local((9, 0))).hardware_compatibility == "none"  # exact arch preferred
    with pytest.raises(EngineError) as e:
        select_engine(m, local((7, 5)))
    assert "ampere+ engines need sm80 or newer, this GPU is sm75" in str(e.value)
    assert "--arch sm75" in str(e.value) and "--hardware-compatibility" not in str(e.value)


def test_no_gpu_no_tensorrt_no_engine() -> None:
    m = manifest(trt_entry("sm90"))
    with pytest.raises(EngineError, match=r"need an NVIDIA GPU.*--backend onnxruntime"):
        select_engine(m, local(cc=None))
    with pytest.raises(EngineError, match=r"pip install 'trtbuild\[tensorrt\]' --extra-index-url"):
        select_engine(m, local(trt=None))
    ort_only = {"manifest_version": 1, "backend": "onnxruntime", "target": "cpu-x86_64-linux", "files": {}}
    with pytest.raises(EngineError) as e:
        select_engine(ort_only, local(), engine_dir="E", checkpoint="C")
    assert "no TensorRT engine (it has: onnxruntime cpu-x86_64-linux)" in str(e.value)
    assert "trtbuild build C -o E --backend tensorrt --arch sm90" in str(e.value)


def test_entry_round_trip_and_validation() -> None:
    entry = trt_entry("sm90", hardware_compatibility="ampere+", version_compatible=True)
    assert entries_from_manifest(manifest(entry)) == [entry]
    assert EngineEntry.from_dict(entry.to_dict()) == entry
    with pytest.raises(EngineError, match="unknown field"):
        EngineEntry.from_dict({**entry.to_dict(), "colour": "green"})
    with pytest.raises(EngineError, match="invalid"):
        EngineEntry.from_dict({**entry.to_dict(), "hardware_compatibility": "hopper+"})
    assert entries_from_manifest({}) == []


@pytest.mark.parametrize(
    ("text", "cc"), [("sm90", (9, 0)), ("sm_86", (8, 6)), ("89", (8, 9)), ("9.0", (9, 0)), ("sm120", (12, 0))]
)
def test_parse_arch(text: str, cc: tuple[int, int]) -> None:
    assert parse_arch(text) == cc


def test_parse_arch_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not a GPU arch"):
        parse_arch("hopper")


def test_resolve_archs() -> None:
    assert resolve_archs(["native"], (8, 6), "none") == [(8, 6)]
    assert resolve_archs(["native", "sm86"], (8, 6), "none") == [(8, 6)]
    with pytest.raises(BuildError) as e:
        resolve_archs(["sm90"], (8, 6), "none")
    assert "cannot build a TensorRT engine for sm90 on this sm86 GPU" in str(e.value)
    assert "--hardware-compatibility ampere+" in str(e.value)
    assert resolve_archs(["sm80", "sm90"], (8, 6), "ampere+") == [(8, 0), (9, 0)]
    with pytest.raises(BuildError, match="sm80 or newer"):
        resolve_archs(["sm75"], (8, 6), "ampere+")
    with pytest.raises(BuildError, match="none was found"):
        resolve_archs(["native"], None, "none")
    with pytest.raises(BuildError, match="--arch volta"):
        resolve_archs(["volta"], (8, 6), "none")


def test_build_without_tensorrt_raises_build_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError, installed or not
    with pytest.raises(BuildError) as e:
        build_tensorrt_engines(tmp_path / "model.onnx", tmp_path / "out", BuildConfig(), ["native"])
    msg = str(e.value)
    assert msg.startswith("TensorRT is not installed: ")
    assert "pip install 'trtbuild[tensorrt]' --extra-index-url https://pypi.nvidia.com" in msg
    assert "\n" not in msg
    assert not (tmp_path / "out").exists()


def test_build_checks_its_options_first(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="hardware-compatibility must be one of none, ampere"):
        build_tensorrt_engines(tmp_path / "m.onnx", tmp_path, BuildConfig(), hardware_compatibility="turing+")
    with pytest.raises(BuildError, match="between 0 and 5"):
        build_tensorrt_engines(tmp_path / "m.onnx", tmp_path, BuildConfig(), builder_optimization_level=7)


def test_detect_local_facts() -> None:
    facts = detect_local_facts()
    assert facts.plugin_version == tensorrt_plugin.PLUGIN_VERSION
    assert facts.compute_capability is None or len(facts.compute_capability) == 2
    if importlib.util.find_spec("tensorrt") is None:
        assert facts.tensorrt_version is None


@pytest.mark.tensorrt
def test_tensorrt_build_and_select(tmp_path: Path) -> None:  # pragma: no cover - needs TensorRT and a GPU
    """On a machine with TensorRT and a GPU: build the tiny hand-made graph, then select and load the engine."""
    trt = pytest.importorskip("tensorrt", reason="needs TensorRT (pip install tensorrt --extra-index-url ...)")
    facts = detect_local_facts()
    if facts.compute_capability is None:
        pytest.skip("needs an NVIDIA GPU")
    import onnx
    from test_tensorrt_lowering import BS, portable_graph

    path = tmp_path / "portable.onnx"
    onnx.save(portable_graph(rope=True), str(path))
    build = BuildConfig(max_batch_size=4, max_seq_len=64, max_num_tokens=32, kv_block_size=BS)
    entries = build_tensorrt_engines(path, tmp_path / "engine", build, ["native"], timing_cache=tmp_path / "tc")
    assert (tmp_path / "tc").stat().st_size > 0
    chosen = select_engine(manifest(*entries), facts)
    engine = trt.Runtime(trt.Logger()).deserialize_cuda_engine((tmp_path / "engine" / chosen.path).read_bytes())
    assert engine is not None


def test_plugin_ptx_newer_than_the_driver_is_explained() -> None:
    m = manifest(trt_entry("sm90", ptx_version="8.8"))
    with pytest.raises(EngineError) as e:
        select_engine(m, LocalFacts((9, 0), TRT, PLUGIN, driver_ptx_version=85))
    assert "its plugin kernel is PTX ISA 8.8 and this driver loads PTX <= 8.5" in str(e.value)
    assert "--ptx-version 85" in str(e.value)
    assert select_engine(m, LocalFacts((9, 0), TRT, PLUGIN, driver_ptx_version=88)).ptx_version == "8.8"
    assert select_engine(m, LocalFacts((9, 0), TRT, PLUGIN, driver_ptx_version=None)).target == "sm90"  # unknown
    assert select_engine(manifest(trt_entry("sm90")), LocalFacts((9, 0), TRT, PLUGIN, 70)).ptx_version is None  # JIT


def test_ptx_cap_follows_the_driver_or_the_flag() -> None:
    assert max_ptx_for_cuda((12, 4)) == 84
    assert max_ptx_for_cuda((12, 7)) == 85  # between listed releases: the older one's ISA
    assert max_ptx_for_cuda((12, 9)) == 88
    assert max_ptx_for_cuda((10, 2)) == 70  # older than the table: its oldest ISA
    assert max_ptx_for_cuda((14, 0)) is None  # newer than the table: no cap
    assert ptx_cap(None, (12, 5)) == 85 and ptx_cap(80, (12, 9)) == 80 and ptx_cap(None, None) is None
    assert ptx_number("8.5") == 85
    driver = driver_cuda_version()  # None here without an NVIDIA driver; (major, minor) with one
    assert driver is None or (isinstance(driver, tuple) and driver >= (11, 0))
