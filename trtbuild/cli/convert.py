"""``trtbuild convert SRC -o CKPT_DIR``; with ``--recipe FILE`` the source and dtype default to the recipe's."""

from __future__ import annotations

from pathlib import Path

import click

from ..config import DType
from ..errors import ConfigError, ConvertError
from .options import OutputPath, explicit_options, load_recipe_option, recipe_option


@click.command()
@click.argument("src", type=click.Path(path_type=Path), required=False)
@click.option("-o", "--output", "output", type=OutputPath(directory=True), required=True, help="checkpoint directory")
@click.option(
    "--dtype",
    type=click.Choice([d.value for d in DType]),
    default=None,
    help="storage dtype of the float weights [default: the source's: a Hugging Face config's dtype / torch_dtype, "
    "float32 for GGUF files]",
)
@click.option(
    "--dequantize",
    is_flag=True,
    help="GGUF files: dequantize every tensor to float (by default Q8_0 / Q5_0 / Q4_0 / Q4_1 tensors and the "
    "K-quants Q6_K / Q5_K / Q4_K / Q3_K / Q2_K stay quantized: a quantized checkpoint, and an engine of the same size "
    "class as the file or larger)",
)
@recipe_option
@click.option("--overwrite", is_flag=True, help="replace an existing output directory")
def convert(
    src: Path | None, output: Path, dtype: str | None, dequantize: bool, recipe: Path | None, overwrite: bool
) -> None:
    """Convert a Hugging Face folder or a .gguf file into a trtbuild checkpoint.

    A GGUF file's Q8_0, Q5_0, Q4_0 and Q4_1 tensors and its K-quants (Q6_K, Q5_K, Q4_K, Q3_K, Q2_K) are kept as
    they are (int8 and int4 codes with scales, and mins where the type has them, per block of 32 or of 16; 5-, 3-
    and 2-bit codes take a byte each): the checkpoint builds into a quantized engine whose weights equal llama.cpp's.
    A fused tensor (q / k / v, gate / up) whose parts differ in type is kept as 8-bit codes with a scale and min per
    block, also exactly, and so is a 4- or 5-bit embedding. Tensors of other quantized types (Q5_1, the IQ types,
    ...) are dequantized, with their fused partners, and one line names them. With --recipe, SRC and --dtype
    default to the recipe's model source and dtype.
    """
    spec = load_recipe_option(recipe)
    if spec is not None:
        src = src if src is not None else spec.model.resolve()
        if "dtype" not in explicit_options({"dtype": dtype}):
            dtype = spec.model.dtype.value
    if src is None:
        raise ConfigError("missing SRC: give a Hugging Face folder or .gguf file (or --recipe FILE)")
    if not src.exists():  # before the converter's imports (torch: ~2 s)
        raise ConvertError(f"{src}: no such file or directory")
    from ..convert.convert import convert as run_convert
    from ..progress import Elapsed

    with Elapsed("converting"):
        result = run_convert(src, output, DType(dtype) if dtype else None, dequantize=dequantize, overwrite=overwrite)
    cfg = result.config
    for line in [*result.notes, result.dequantized_line()]:
        if line is not None:
            click.echo(line)
    q = cfg.quantization
    kept = f", {q.qformat.value} g{q.group_size}" if q is not None else ""
    click.echo(
        f"converted {cfg.architecture} ({cfg.num_layers} layers, {result.num_tensors} tensors, "
        f"{cfg.dtype.value}{kept}) -> {output} in {result.seconds:.1f}s"
    )
