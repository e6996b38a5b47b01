"""The stage graph of one or more recipes: convert -> (quantize) -> build -> (eval), one stage per artifact.

Every stage writes exactly one artifact, named by its path relative to ARTIFACTS_DIR (the stage id)::

    <model>/checkpoint                          convert: the source in the model's dtype
    <model>/<format>/checkpoint                 quantize: formats with a quantization section
    <model>/<format>/<backend>/<arch>           build: an engine directory (manifest.json inside)
    <model>/<format>/<backend>/<arch>.eval.json eval: recipes with an accuracy gate

Recipes that ask for the same artifact share its stage; asking for it with different options is an error.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Backend
from ..configio import to_dict
from ..errors import ConfigError
from ..recipe import FormatSpec, Recipe, TargetSpec

CHECKPOINT_DIR = "checkpoint"  # reserved: never a format name


class StageKind(enum.Enum):
    CONVERT = "convert"
    QUANTIZE = "quantize"
    BUILD = "build"
    EVAL = "eval"


@dataclass(frozen=True)
class Stage:
    """One node of the graph. ``options`` is plain JSON data: it goes into the cache key verbatim."""

    kind: StageKind
    id: str  # the artifact path relative to ARTIFACTS_DIR
    deps: tuple[str, ...]  # ids of the stages whose artifacts this one reads, in argument order
    options: dict[str, Any]
    source: Path | None = None  # convert only: the model source file or folder
    data_files: tuple[Path, ...] = ()  # other files it reads (datasets given as paths): their content is an input
    labels: dict[str, str] = field(default_factory=dict)  # model / format / backend / target, for index.json

    def describe(self) -> str:
        return f"{self.kind.value} {self.id}"


@dataclass(frozen=True)
class Plan:
    """Stages in dependency order, plus the recipes they came from."""

    stages: list[Stage]
    recipes: list[Recipe]

    def by_id(self) -> dict[str, Stage]:
        return {s.id: s for s in self.stages}


def _matches(target: TargetSpec, filters: tuple[str, ...]) -> bool:
    return not filters or target.arch in filters or target.label in filters or target.backend.value in filters


def make_plan(recipes: list[Recipe], target_filters: tuple[str, ...] = ()) -> Plan:
    """The stages of ``recipes`` restricted to targets matching ``target_filters`` (arch, backend or backend/arch)."""
    stages: dict[str, Stage] = {}
    owner: dict[str, str] = {}

    def add(stage: Stage, recipe: Recipe) -> str:
        old = stages.get(stage.id)
        if old is None:
            stages[stage.id] = stage
            owner[stage.id] = recipe.name
        elif old != stage:  # same artifact, other options or inputs
            raise ConfigError(
                f"recipes {owner[stage.id]} and {recipe.name} both make {stage.id}, with different "
                "options (give the models or formats different names)"
            )
        return stage.id

    matched = False
    for recipe in recipes:
        targets = [t for t in recipe.targets if _matches(t, target_filters)]
        matched = matched or bool(targets)
        if not targets:
            continue
        model = recipe.model.name
        source = recipe.model.resolve()
        ckpt = add(
            Stage(
                StageKind.CONVERT,
                f"{model}/{CHECKPOINT_DIR}",
                (),
                {"dtype": recipe.model.dtype.value},
                source=source,
                labels={"model": model},
            ),
            recipe,
        )
        for fmt in recipe.formats:
            fmt_targets = [t for t in recipe.targets_of(fmt) if t in targets]
            if not fmt_targets:
                continue
            fmt_ckpt = _format_checkpoint(recipe, fmt, ckpt, add)
            for target in fmt_targets:
                labels = {"model": model, "format": fmt.name, "backend": target.backend.value, "target": target.arch}
                build_opts = {"build": to_dict(recipe.build_for(target))}
                if target.backend is Backend.TENSORRT:
                    build_opts["tensorrt"] = to_dict(recipe.tensorrt_for(target))
                if target.backend is Backend.TORCH:
                    build_opts["torch"] = to_dict(recipe.torch_for(target))
                engine = add(
                    Stage(
                        StageKind.BUILD, f"{model}/{fmt.name}/{target.label}", (fmt_ckpt,), build_opts, labels=labels
                    ),
                    recipe,
                )
                gate = recipe.accuracy_gate
                if gate is not None:
                    eval_stage = Stage(
                        StageKind.EVAL,
                        f"{engine}.eval.json",
                        (engine,),
                        {"eval": to_dict(gate.eval)},  # the threshold is judged afterwards, not a stage input
                        data_files=_data_files(gate.eval.dataset),
                        labels=labels,
                    )
                    add(eval_stage, recipe)
    if target_filters and not matched:
        raise ConfigError(f"--target {', '.join(target_filters)}: no recipe has such a target")
    return Plan(list(stages.values()), recipes)


def _format_checkpoint(recipe: Recipe, fmt: FormatSpec, ckpt: str, add: Any) -> str:
    if fmt.name == CHECKPOINT_DIR:
        raise ConfigError(f"recipe {recipe.name}: format name {CHECKPOINT_DIR!r} is reserved")
    if fmt.quantization is None:
        return ckpt
    labels = {"model": recipe.model.name, "format": fmt.name}
    stage_id = f"{recipe.model.name}/{fmt.name}/{CHECKPOINT_DIR}"
    options = {"quantization": to_dict(fmt.quantization)}
    files = _data_files(fmt.quantization.calib_dataset)
    return add(Stage(StageKind.QUANTIZE, stage_id, (ckpt,), options, data_files=files, labels=labels), recipe)


def _data_files(dataset: str) -> tuple[Path, ...]:
    """A dataset given as a file path (not a dataset name) is read by the stage: its content joins the key."""
    return (Path(dataset),) if Path(dataset).is_file() else ()
