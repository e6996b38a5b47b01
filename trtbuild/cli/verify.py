"""``trtbuild verify PATH``: an engine directory (or a pipeline's ARTIFACTS_DIR) is complete, intact, runnable here."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--quiet", "-q", is_flag=True, help="print problems only")
def verify(path: Path, quiet: bool) -> None:
    """Check an engine directory against its manifest and this machine, or a pipeline ARTIFACTS_DIR (index.json).

    Exits 1 after printing one line per problem: a missing, extra or modified file, an onnxruntime major.minor
    or TensorRT/GPU mismatch, a CPU target other than this machine's.
    """
    from ..artifacts.verify import INDEX, verify_artifacts, verify_engine_dir

    report = verify_artifacts(path) if (path / INDEX).is_file() else verify_engine_dir(path)
    if not quiet:
        for note in report.notes:
            click.echo(f"note: {note}")
    for problem in report.problems:
        click.echo(f"problem: {problem}", err=True)
    if report.problems:
        click.echo(f"verify: {path}: {len(report.problems)} problem(s)", err=True)
        sys.exit(1)
    if not quiet:
        click.echo(f"ok: {path} ({report.checked_files} files, {report.total_bytes / 2**20:.1f} MiB verified)")
