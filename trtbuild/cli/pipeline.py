"""``trtbuild pipeline RECIPE... -o ARTIFACTS_DIR [--jobs N] [--dry-run] [--target T]``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .options import OutputPath


@click.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    "output",
    type=OutputPath(directory=True),
    required=True,
    help="artifacts directory (reused between runs: unchanged stages are cached)",
)
@click.option(
    "-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True, help="stages run at the same time"
)
@click.option("--dry-run", is_flag=True, help="show which stages would run and why, run nothing")
@click.option(
    "--strict",
    is_flag=True,
    help="exit non-zero when a target cannot be built on this machine (its toolchain, e.g. TensorRT, is missing)",
)
@click.option(
    "--target",
    "targets",
    multiple=True,
    help="only these targets: an arch (cpu, sm90), a backend (tensorrt) or backend/arch; repeatable",
)
def pipeline(
    recipes: tuple[Path, ...], output: Path, jobs: int, dry_run: bool, strict: bool, targets: tuple[str, ...]
) -> None:
    """Convert, quantize, build and evaluate every format x target of the RECIPES into ARTIFACTS_DIR.

    Each stage is cached by the content hash of its inputs and options: a second run with nothing changed does no
    work, and a changed option reruns only the stages that depend on it. Writes ARTIFACTS_DIR/index.json
    (--dry-run writes nothing). Targets whose toolchain is missing here (TensorRT) are reported as not buildable
    on this machine, with the command to run where it is; the rest completes, and the exit status is 0 unless
    --strict.
    """
    from ..pipeline.plan import StageKind, make_plan
    from ..pipeline.runner import PipelineError, Status, run_pipeline
    from ..recipe import load_recipe

    plan = make_plan([load_recipe(p) for p in recipes], targets)
    stdout = sys.stdout  # bound now: a library that redirects sys.stdout while a stage runs cannot swallow progress
    run = run_pipeline(plan, output, jobs=jobs, dry_run=dry_run, report=lambda line: click.echo(line, file=stdout))
    for gate in run.gates:
        click.echo(gate.message)
    counts: dict[Status, int] = {}
    for outcome in run.outcomes.values():
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    summary = ", ".join(f"{n} {status.value}" for status, n in counts.items())
    where = "" if dry_run else f" -> {output / 'index.json'}"
    click.echo(
        f"{'dry run' if dry_run else 'pipeline'}: {len(plan.stages)} stages ({summary}) in {run.seconds:.1f}s{where}"
    )
    elsewhere = sorted(
        {o.stage.labels["backend"] + "/" + o.stage.labels["target"]: o.reason
         for o in run.outcomes.values() if o.status is Status.NOT_BUILDABLE and o.stage.kind is StageKind.BUILD}.items()
    )  # fmt: skip
    for label, why in elsewhere:
        command = f"trtbuild pipeline {' '.join(map(str, recipes))} -o {output} --target {label}"
        click.echo(f"not buildable on this machine: {label} ({why}); where it is: {command}", err=True)
    if elsewhere and strict:
        raise PipelineError(f"--strict: {len(elsewhere)} target(s) not buildable on this machine")
