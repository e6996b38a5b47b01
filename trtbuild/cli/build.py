"""``trtbuild build CKPT_DIR -o ENGINE_DIR --backend onnxruntime``."""

from __future__ import annotations

from pathlib import Path

import click

from ..config import BuildConfig
from .options import config_from_options, dataclass_options


@click.command()
@click.argument("ckpt_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), required=True, help="engine directory")
@dataclass_options(BuildConfig)
@click.option("--overwrite", is_flag=True, help="replace an existing output directory")
def build(ckpt_dir: Path, output: Path, overwrite: bool, **options: object) -> None:
    """Build an engine directory from a checkpoint."""
    from ..build import build_engine

    cfg = config_from_options(BuildConfig, options)
    result = build_engine(ckpt_dir, output, cfg, overwrite=overwrite)
    plugin_nodes = result.portable_op_counts.get("trtbuild::PagedAttention", 0)
    click.echo(
        f"built {cfg.backend.value} engine -> {output} in {result.seconds:.1f}s "
        f"({sum(result.engine_op_counts.values())} nodes; portable graph: {plugin_nodes} PagedAttention)"
    )
