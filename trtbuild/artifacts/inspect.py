"""``trtbuild inspect``: what a checkpoint or engine directory holds, as plain data or text.

- checkpoint (``config.json`` + ``rank0.safetensors``): the model config, its quantization, a tensor table read
  from the safetensors header (name, dtype, shape, bytes; no tensor data is loaded), file sizes;
- tensors and files in natural order (``layers.2`` before ``layers.10``);
- engine directory (``manifest.json``): backend, target, versions, build options, the model config and
  quantization of ``runtime_config.json``, op counts by type (the manifest's graph section), the engine's
  initializer table (from the ONNX graph without its external data), file sizes.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from ..errors import TrtbuildError
from .manifest import MANIFEST

SMALL_TENSOR_BYTES = 64  # text output: engine constants smaller than this are counted, not listed
WEIGHTS_FILE = "rank0.safetensors"  # checkpoint.files.WEIGHTS_FILE (not imported: that module imports this one)


FILE_KINDS = {  # by suffix, for messages about a file given where a directory belongs
    ".gguf": "a GGUF file",
    ".safetensors": "a safetensors file",
    ".onnx": "an ONNX model file",
    ".json": "a JSON file",
    ".jsonl": "a JSON-lines file",
    ".yaml": "a YAML file",
}


def not_a_directory(path: Path, what: str, hint: str = "") -> str:
    """The one-line message for ``path`` where a directory was expected (``what``: "engine directory"): what the
    path is instead, a kind of file or nothing; ``hint`` says where such a directory comes from."""
    article = "an" if what[0] in "aeiou" else "a"
    if path.suffix.lower() == ".gguf" and path.is_file():
        hint = f"make a checkpoint of it with `trtbuild convert {path} -o CKPT_DIR`"
    if path.is_file():
        message = f"{path}: {FILE_KINDS.get(path.suffix.lower(), 'a file')}, not {article} {what}"
    elif path.exists():
        message = f"{path}: not {article} {what} (not a directory)"
    else:
        message = f"{path}: no such {what}"
    return message + (f" ({hint})" if hint else "")


def inspect_path(path: Path) -> dict[str, Any]:
    """A JSON-able description of the checkpoint or engine directory at ``path``."""
    if not path.is_dir():
        raise TrtbuildError(not_a_directory(path, "checkpoint or engine directory"))
    if (path / MANIFEST).is_file():
        return _inspect_engine(path)
    if (path / "config.json").is_file() and (path / WEIGHTS_FILE).is_file():
        return _inspect_checkpoint(path)
    if (path / "runtime_config.json").is_file():
        raise TrtbuildError(f"{path}: an engine directory without {MANIFEST}, so not a finished engine (an "
                            "interrupted build, or a copy without it)")  # fmt: skip
    raise TrtbuildError(f"{path}: neither a checkpoint (config.json + {WEIGHTS_FILE}) nor an engine (manifest.json)")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TrtbuildError(f"{path}: not valid JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise TrtbuildError(f"{path}: expected a JSON object")
    return data


def natural_key(name: str) -> list[str | int]:
    """Sort key that orders the numbers inside names by value: ``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _files(directory: Path) -> dict[str, int]:
    paths = sorted((p for p in directory.rglob("*") if p.is_file()), key=lambda p: natural_key(p.as_posix()))
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in paths}


def safetensors_table(path: Path) -> list[dict[str, Any]]:
    """Name, dtype, shape and byte size of every tensor of a safetensors file, from its header alone.

    The header's data offsets must cover the file's data exactly (as the safetensors loader requires): a truncated
    file (an interrupted copy or download) or one with bytes past its last tensor raises ``TrtbuildError``.
    """
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError("header larger than 100 MiB")
            raw = f.read(length)
            if len(raw) < length:
                raise ValueError(f"the file ends inside its {length}-byte header")
            header = json.loads(raw)
        rows = []
        for name, meta in sorted(header.items(), key=lambda item: natural_key(item[0])):
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            if not 0 <= start <= end:
                raise ValueError(f"tensor {name} has data offsets {start}..{end}")
            rows.append({"name": name, "dtype": meta["dtype"], "shape": list(meta["shape"]), "bytes": end - start,
                         "end": end})  # fmt: skip
    except (struct.error, ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise TrtbuildError(f"{path}: not a readable safetensors file ({e})") from None
    data = path.stat().st_size - 8 - length
    described = max((r.pop("end") for r in rows), default=0)
    if described > data:
        raise TrtbuildError(
            f"{path}: truncated: its header describes {described} bytes of tensor data, the file holds {data} "
            "(an interrupted copy or download?)"
        )
    if described < data:
        raise TrtbuildError(f"{path}: {data - described} bytes after the last tensor (not a valid safetensors file)")
    return rows


def _inspect_checkpoint(path: Path) -> dict[str, Any]:
    config = _read_json(path / "config.json")
    return {
        "kind": "checkpoint",
        "path": str(path),
        "config": config,
        "quantization": config.get("quantization"),
        "tensors": safetensors_table(path / WEIGHTS_FILE),
        "files": _files(path),
    }


def onnx_initializer_table(model_path: Path) -> list[dict[str, Any]]:
    """Name, dtype, shape and byte size of every initializer of an ONNX model (external data is not read)."""
    import math

    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    rows = []
    for t in model.graph.initializer:
        dtype = onnx.TensorProto.DataType.Name(t.data_type).lower()
        bits = {
            "float": 32,
            "double": 64,
            "float16": 16,
            "bfloat16": 16,
            "int64": 64,
            "int32": 32,
            "int16": 16,
            "uint16": 16,
            "int8": 8,
            "uint8": 8,
            "bool": 8,
            "int4": 4,
            "uint4": 4,
        }.get(dtype, 8)
        if dtype.startswith("float8"):
            bits = 8
        rows.append(
            {
                "name": t.name,
                "dtype": "float32" if dtype == "float" else dtype,
                "shape": list(t.dims),
                "bytes": (math.prod(t.dims) * bits + 7) // 8,
            }
        )
    return sorted(rows, key=lambda r: natural_key(r["name"]))


def _inspect_engine(path: Path) -> dict[str, Any]:
    manifest = _read_json(path / MANIFEST)
    runtime = _read_json(path / "runtime_config.json") if (path / "runtime_config.json").is_file() else {}
    model = runtime.get("model", {})
    engine_file = runtime.get("engine_file")
    tensors: list[dict[str, Any]] = []
    if isinstance(engine_file, str) and engine_file.endswith(".onnx") and (path / engine_file).is_file():
        try:
            tensors = onnx_initializer_table(path / engine_file)
        except ImportError:  # onnx is a build-time dependency; an engine-only install has no tensor table
            tensors = []
    graph = manifest.get("graph", {})
    return {
        "kind": "engine",
        "path": str(path),
        "backend": manifest.get("backend"),
        "target": manifest.get("target"),
        "engines": manifest.get("engines"),
        "versions": manifest.get("versions", {}),
        "build_options": manifest.get("build_options", runtime.get("build")),
        "checkpoint": manifest.get("checkpoint"),
        "config": model,
        "quantization": model.get("quantization") if isinstance(model, dict) else None,
        "op_counts": graph.get("engine_op_counts", {}),
        "portable_op_counts": graph.get("portable_op_counts", {}),
        "tensors": tensors,
        "files": _files(path),
        "manifest": manifest,
    }


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _kv(title: str, data: dict[str, Any] | None) -> list[str]:
    if not data:
        return [f"{title}: none"]
    lines = [f"{title}:"]
    for k, v in data.items():
        lines.append(f"  {k}: {json.dumps(v) if isinstance(v, dict | list) else v}")
    return lines


def render_text(info: dict[str, Any]) -> str:
    """The human-readable form of ``inspect_path``'s result."""
    lines = [f"{info['kind']}: {info['path']}"]
    if info["kind"] == "engine":
        lines.append(f"backend: {info['backend']}  target: {info['target']}")
        lines += _kv("versions", info["versions"])
        lines += _kv("build options", info["build_options"])
    config = {k: v for k, v in info["config"].items() if k != "quantization"}
    lines += _kv("config", config)
    lines += _kv("quantization", info["quantization"])
    if info["kind"] == "engine":
        for title, key in (("engine op counts", "op_counts"), ("portable graph op counts", "portable_op_counts")):
            counts = info[key]
            lines.append(f"{title} ({sum(counts.values())} nodes):")
            lines += [f"  {op:<32} {n:>6}" for op, n in counts.items()]
    tensors = info["tensors"]
    total = sum(t["bytes"] for t in tensors)
    shown = [t for t in tensors if t["bytes"] >= SMALL_TENSOR_BYTES or info["kind"] == "checkpoint"]
    small = len(tensors) - len(shown)
    lines.append(
        f"tensors ({len(tensors)}, {_size(total)})"
        + (f", {small} under {SMALL_TENSOR_BYTES} B not shown:" if small else ":")
    )
    name_w = max((len(t["name"]) for t in shown), default=0)
    shapes = ["x".join(map(str, t["shape"])) or "scalar" for t in shown]
    shape_w = max(map(len, shapes), default=0)
    for t, shape in zip(shown, shapes, strict=True):
        lines.append(f"  {t['name']:<{name_w}}  {t['dtype']:<9} {shape:<{shape_w}}  {_size(t['bytes']):>10}")
    files = info["files"]
    lines.append(f"files ({len(files)}, {_size(sum(files.values()))}):")
    lines += [f"  {name:<48} {_size(n):>10}" for name, n in files.items()]
    return "\n".join(lines)
