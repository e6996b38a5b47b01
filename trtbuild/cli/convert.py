"""``trtbuild convert SRC -o CKPT_DIR``."""

from __future__ import annotations

from pathlib import Path

import click

from ..config import DType


@click.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), required=True, help="checkpoint directory")
@click.option(
    "--dtype",
    type=click.Choice([d.value for d in DType]),
    default=DType.FLOAT32.value,
    show_default=True,
    help="storage dtype of the weights",
)
@click.option("--overwrite", is_flag=True, help="replace an existing output directory")
def convert(src: Path, output: Path, dtype: str, overwrite: bool) -> None:
    """Convert a Hugging Face folder or a .gguf file into a trtbuild checkpoint."""
    from ..convert.convert import convert as run_convert

    result = run_convert(src, output, DType(dtype), overwrite=overwrite)
    cfg = result.config
    click.echo(
        f"converted {cfg.architecture} ({cfg.num_layers} layers, {result.num_tensors} tensors, "
        f"{cfg.dtype.value}) -> {output} in {result.seconds:.1f}s"
    )
