"""``trtbuild convert SRC -o CKPT_DIR``; with ``--recipe FILE`` the source and dtype default to the recipe's."""

from __future__ import annotations

from pathlib import Path

import click

from ..config import DType
from ..errors import ConfigError
from .options import OutputPath, explicit_options, load_recipe_option, recipe_option


@click.command()
@click.argument("src", type=click.Path(path_type=Path), required=False)
@click.option("-o", "--output", "output", type=OutputPath(directory=True), required=True, help="checkpoint directory")
@click.option(
    "--dtype",
    type=click.Choice([d.value for d in DType]),
    default=DType.FLOAT32.value,
    show_default=True,
    help="storage dtype of the weights",
)
@recipe_option
@click.option("--overwrite", is_flag=True, help="replace an existing output directory")
def convert(src: Path | None, output: Path, dtype: str, recipe: Path | None, overwrite: bool) -> None:
    """Convert a Hugging Face folder or a .gguf file into a trtbuild checkpoint.

    With --recipe, SRC and --dtype default to the recipe's model source and dtype.
    """
    from ..convert.convert import convert as run_convert

    spec = load_recipe_option(recipe)
    if spec is not None:
        src = src if src is not None else spec.model.resolve()
        if "dtype" not in explicit_options({"dtype": dtype}):
            dtype = spec.model.dtype.value
    if src is None:
        raise ConfigError("missing SRC: give a Hugging Face folder or .gguf file (or --recipe FILE)")
    result = run_convert(src, output, DType(dtype), overwrite=overwrite)
    cfg = result.config
    click.echo(
        f"converted {cfg.architecture} ({cfg.num_layers} layers, {result.num_tensors} tensors, "
        f"{cfg.dtype.value}) -> {output} in {result.seconds:.1f}s"
    )
