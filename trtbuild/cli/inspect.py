"""``trtbuild inspect PATH [--json]``: a checkpoint's or an engine directory's config, tensors, ops and sizes."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of text")
def inspect(path: Path, as_json: bool) -> None:
    """Show what the checkpoint or engine directory PATH holds."""
    from ..artifacts.inspect import inspect_path, render_text

    info = inspect_path(path)
    click.echo(json.dumps(info, indent=2) if as_json else render_text(info))
