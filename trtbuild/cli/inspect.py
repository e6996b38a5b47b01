"""``trtbuild inspect PATH [--json]``: a checkpoint's or an engine directory's config, tensors, ops and sizes; for a
source (a Hugging Face folder or a ``.gguf`` file), whether ``trtbuild convert`` takes it and, if not, why."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..errors import TrtbuildError


@click.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of text")
def inspect(path: Path, as_json: bool) -> None:
    """Show what the checkpoint or engine directory PATH holds, or whether the Hugging Face folder or .gguf file
    PATH converts.

    For a source, nothing is converted and no tensor data is read: the report lists every reason convert would
    refuse it, or the model it would write. Exit status 0 when it converts, 1 when it does not (one summary line on
    stderr), 2 when PATH cannot be inspected.
    """
    if not path.exists():  # before the source checker's imports (torch: ~2 s)
        raise TrtbuildError(f"{path}: no such file or directory")
    from ..convert.support import is_source

    if is_source(path):
        _inspect_source(path, as_json)
        return
    from ..artifacts.inspect import inspect_path, render_text

    info = inspect_path(path)
    click.echo(json.dumps(info, indent=2) if as_json else render_text(info))


def _inspect_source(path: Path, as_json: bool) -> None:
    from ..convert.support import check_source

    report = check_source(path)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.render_text())
    if not report.supported:
        click.echo(f"inspect: {report.summary_line()}", err=True)
        sys.exit(1)
