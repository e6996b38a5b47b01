"""The TensorRT backend: portable graph -> lowered ONNX -> one serialized TensorRT engine per GPU arch.

TensorRT is an optional extra (``pip install 'trtbuild[tensorrt]' --extra-index-url https://pypi.nvidia.com``),
imported only inside :func:`build_tensorrt_engines`; everything before the import (argument checks, arch
resolution) is plain Python. Layout written under ``out_dir``::

    engines/tensorrt-sm{XY}/engine.plan          the serialized engine
    engines/tensorrt-sm{XY}/cache_aliases.json   {cache output: cache input}: bind both to the same device buffer

TensorRT builds for the GPU it runs on: an arch other than the local GPU's is refused unless
``hardware_compatibility="ampere+"``, which builds one engine that runs on every GPU from sm80 (then written once
per requested arch, with the plugin's PTX compiled for sm80 so the driver can JIT it for newer GPUs).

Not verified here (no GPU, no TensorRT on the CI machines): every line after ``import tensorrt``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import onnx
from google.protobuf.message import DecodeError

from ....artifacts.engine_select import (
    AMPERE,
    HARDWARE_COMPATIBILITY,
    EngineEntry,
    arch_name,
    local_compute_capability,
    parse_arch,
)
from ....artifacts.ptx import driver_cuda_version, ptx_cap
from ....config import BuildConfig
from ....errors import BuildError
from .lowering import cache_aliases, lower_for_tensorrt, profile_shapes

INSTALL_HINT = "pip install 'trtbuild[tensorrt]' --extra-index-url https://pypi.nvidia.com"
PLUGIN_IMPLS = ("auto", "aot", "jit")


def build_tensorrt_engines(
    portable_onnx_path: Path,
    out_dir: Path,
    build: BuildConfig,
    archs: Sequence[str] = ("native",),
    hardware_compatibility: str = "none",
    version_compatible: bool = False,
    timing_cache: Path | None = None,
    builder_optimization_level: int | None = None,
    *,
    plugin_impl: str = "auto",
    ptx_version: int | None = None,
) -> list[EngineEntry]:
    """Build one engine per arch of ``archs`` ("native" = this GPU, or "sm90", "90", "9.0") into ``out_dir``.

    ``timing_cache`` is read if it exists and written back after the build. ``plugin_impl``: "aot" embeds the
    plugin's PTX (the engine runs without Python), "jit" calls back into Python, "auto" picks AOT when the
    installed TensorRT supports it. ``ptx_version`` (e.g. 85) caps the AOT kernel's PTX ISA; by default it is capped
    at what this machine's driver loads. Returns the manifest entries (paths relative to ``out_dir``).
    """
    if hardware_compatibility not in HARDWARE_COMPATIBILITY:
        raise BuildError(f"--hardware-compatibility must be one of {', '.join(HARDWARE_COMPATIBILITY)}")
    if builder_optimization_level is not None and not 0 <= builder_optimization_level <= 5:
        raise BuildError("--builder-optimization-level must be between 0 and 5")
    if plugin_impl not in PLUGIN_IMPLS:
        raise BuildError(f"plugin implementation must be one of {', '.join(PLUGIN_IMPLS)}")
    if not archs:
        raise BuildError("no --arch given")
    trt = require_tensorrt()
    local = local_compute_capability()
    targets = resolve_archs(archs, local, hardware_compatibility)
    assert local is not None  # resolve_archs refuses a machine without a GPU

    from ....plugins.paged_attention import tensorrt_plugin

    aot_supported = tensorrt_plugin.register()
    if plugin_impl == "aot" and not aot_supported:
        raise BuildError(f"TensorRT {trt.__version__} has no AOT Python plugins; use the JIT plugin implementation")
    aot = {"auto": True if aot_supported else None, "aot": True, "jit": False}[plugin_impl]
    portable_hw = hardware_compatibility == "ampere+"
    cap = ptx_cap(ptx_version, driver_cuda_version())  # a driver older than Triton's default PTX ISA loads this
    tensorrt_plugin.configure_aot(80 if portable_hw else local[0] * 10 + local[1], cap)

    model = _load(portable_onnx_path)
    lowered = lower_for_tensorrt(model, build, aot=aot)
    del model
    plan = _build_plan(trt, lowered, build, hardware_compatibility, version_compatible, timing_cache,
                       builder_optimization_level)  # fmt: skip
    entries = []
    for target in targets:
        rel = Path("engines") / f"tensorrt-{arch_name(target)}" / "engine.plan"
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (out_dir / rel).write_bytes(plan)
        aliases = json.dumps(cache_aliases(lowered), indent=2, sort_keys=True) + "\n"
        (out_dir / rel).with_name("cache_aliases.json").write_text(aliases)
        entries.append(
            EngineEntry(
                backend="tensorrt",
                target=arch_name(target),
                path=rel.as_posix(),
                tensorrt_version=str(trt.__version__),
                compute_capability=f"{local[0]}.{local[1]}",
                hardware_compatibility=hardware_compatibility,
                version_compatible=version_compatible,
                plugin_version=tensorrt_plugin.PLUGIN_VERSION,
                ptx_version=tensorrt_plugin.compiled_ptx_isa() if aot is not False else None,
            )
        )
    return entries


def resolve_archs(
    archs: Sequence[str], local: tuple[int, int] | None, hardware_compatibility: str
) -> list[tuple[int, int]]:
    """The compute capabilities to build for; refuses what TensorRT cannot build on this machine."""
    if local is None:
        raise BuildError("TensorRT engines are built on an NVIDIA GPU and none was found (nvidia-smi / torch.cuda)")
    targets: list[tuple[int, int]] = []
    for arch in archs:
        try:
            target = local if arch == "native" else parse_arch(arch)
        except ValueError as e:
            raise BuildError(f"--arch {arch}: {e}") from None
        if hardware_compatibility == "ampere+":
            if local < AMPERE or target < AMPERE:
                raise BuildError(
                    f"--hardware-compatibility ampere+ needs an sm80 or newer build GPU and targets "
                    f"(build GPU {arch_name(local)}, target {arch_name(target)})"
                )
        elif target != local:
            raise BuildError(
                f"cannot build a TensorRT engine for {arch_name(target)} on this {arch_name(local)} GPU: TensorRT "
                f"builds for the GPU it runs on. Build on an {arch_name(target)} machine, or add "
                "--hardware-compatibility ampere+ for one engine that runs on every GPU from sm80 (may be slower)"
            )
        if target not in targets:
            targets.append(target)
    return targets


def require_tensorrt() -> ModuleType:
    try:
        import tensorrt
    except ImportError:
        raise BuildError(
            f"TensorRT is not installed: {INSTALL_HINT} (see docs/tensorrt.md; needs an NVIDIA GPU and driver)"
        ) from None
    return tensorrt


def _load(path: Path) -> onnx.ModelProto:
    try:
        return onnx.load(str(path))  # with its external data
    except (OSError, ValueError, DecodeError) as e:
        raise BuildError(f"{path}: cannot load the portable graph ({e})") from None


def _build_plan(
    trt: ModuleType,
    lowered: onnx.ModelProto,
    build: BuildConfig,
    hardware_compatibility: str,
    version_compatible: bool,
    timing_cache: Path | None,
    optimization_level: int | None,
) -> bytes:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # Strongly typed: every tensor keeps the type the graph gives it (weak typing is deprecated since TensorRT 10.12).
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile_shapes(lowered, build).items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)  # caches written in place
    if hardware_compatibility == "ampere+":
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    if version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if optimization_level is not None:
        config.builder_optimization_level = optimization_level
    if timing_cache is not None:
        data = timing_cache.read_bytes() if timing_cache.is_file() else b""
        config.set_timing_cache(config.create_timing_cache(data), False)
    with tempfile.TemporaryDirectory(prefix="trtbuild-trt-") as tmp:  # the parser reads the weights from here
        path = Path(tmp) / "model.onnx"
        onnx.save_model(lowered, str(path), save_as_external_data=True, location="model.onnx.data")
        if not parser.parse_from_file(str(path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise BuildError(f"TensorRT's ONNX parser rejected the lowered graph: {errors}")
        plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError("TensorRT failed to build the engine (see the TensorRT log above)")
    if timing_cache is not None:
        tmp_cache = timing_cache.with_name(timing_cache.name + ".tmp")
        tmp_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
        os.replace(tmp_cache, timing_cache)
    return bytes(plan)
