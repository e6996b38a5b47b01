"""``trtbuild quantize SRC -o QCKPT_DIR --qformat FORMAT [--kv-cache-dtype int8|fp8] [--group-size N] ...``."""

from __future__ import annotations

from pathlib import Path

import click

from ..config import QFormat, QuantConfig
from .options import OutputPath, config_with_defaults, dataclass_options, load_recipe_option, recipe_option

# Perplexity increase over fp32 of SmolLM2-135M on flask_docs (8 x 512 tokens, technical prose with code, another
# domain than the default calibration text), group 128 (docs/quantization.md): int4_awq with the LM head int8 (the
# default; "The LM head, quantized by default"), the others with it in float ("int4 with trtbuild's calibration";
# the int8 head adds ~0.3 points). Printed after an int4 quantization, so nobody ships int4 unaware of its cost.
INT4_PERPLEXITY_COST = {
    (QFormat.INT4_WO, False): 68.0,
    (QFormat.INT4_WO, True): 38.3,
    (QFormat.INT4_AWQ, False): 35.8,
    (QFormat.INT4_AWQ, True): 24.5,
}


def int4_note(cfg: QuantConfig, output: Path, *, zero_points_possible: bool = True) -> str | None:
    """The accuracy warning an int4 quantization prints (None for other formats); ``zero_points_possible``: whether
    to suggest ``--zero-points`` (not for mixture-of-experts models, whose int4 experts are symmetric)."""
    cost = INT4_PERPLEXITY_COST.get((cfg.qformat, cfg.zero_points))
    if cost is None:
        return None
    better = "" if cfg.zero_points or not zero_points_possible else "; --zero-points costs less"
    return (
        f"note: int4 costs accuracy: {cfg.qformat.value} g128 raised SmolLM2-135M's perplexity on technical text by "
        f"+{cost:.1f}%{better} (docs/quantization.md). Measure this model: "
        f"trtbuild build {output} -o ENGINE && trtbuild eval ENGINE (and its float engine)"
    )


@click.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.option("-o", "--output", "output", type=OutputPath(directory=True), required=True, help="checkpoint directory")
@click.option(
    "--qformat",
    "qformat",
    metavar="[" + "|".join(f.value for f in QFormat) + "]",
    default=None,
    help="quantization format (required unless --recipe gives it)",
)
@dataclass_options(QuantConfig, exclude=("qformat", "exclude", "tensor_formats", "tensor_group_sizes"))
@click.option(
    "--exclude",
    "exclude",
    multiple=True,
    metavar="PATTERN",
    help="canonical linear kept in float, fnmatch pattern (e.g. 'lm_head', 'layers.0.*', 'layers.*.mlp.down'); "
    "repeat for several [default: none: every linear is quantized, the LM head int8 weight-only in every format; "
    "`--exclude lm_head` keeps it in float, 1.5-1.9x slower batch-1 decode on SmolLM2]",
)
@recipe_option
@click.option("--format", "format_name", default=None, help="the recipe format whose quantization section to use")
@click.option("--overwrite", is_flag=True, help="replace an existing output directory")
@click.option("--quiet", is_flag=True, help="no progress bar")
def quantize(
    src: Path,
    output: Path,
    qformat: str | None,
    exclude: tuple[str, ...],
    recipe: Path | None,
    format_name: str | None,
    overwrite: bool,
    quiet: bool,
    **options: object,
) -> None:
    """Quantize a trtbuild checkpoint (or a Hugging Face folder / .gguf file) with modelopt calibration.

    SRC is calibrated on --calib-size windows of --calib-seq-len tokens of the calibration split of
    --calib-dataset (a dataset name: lee_news, flask_docs, shakespeare; or a .txt / .jsonl file). The result is a
    checkpoint with quantized weights and scales under canonical names and a `quantization` block in config.json;
    build it with `trtbuild build`. With --recipe [--format NAME], that format's quantization section supplies the
    defaults; flags typed here override them.
    """
    from ..errors import ConfigError
    from ..quantize.quantize import quantize as run_quantize
    from ..recipe import recipe_quant_config

    spec = load_recipe_option(recipe)
    defaults = recipe_quant_config(spec, format_name) if spec is not None else None
    if qformat is None and defaults is None:
        raise ConfigError("--qformat is required (or --recipe with a quantized format)")
    fixed: dict[str, object] = {} if qformat is None else {"qformat": qformat}
    if exclude:
        fixed["exclude"] = list(exclude)
    cfg = config_with_defaults(QuantConfig, options, defaults, **fixed)
    result = run_quantize(src, output, cfg, overwrite=overwrite, progress=not quiet)
    size = sum(p.stat().st_size for p in output.rglob("*") if p.is_file()) / 2**20
    kv = "" if cfg.kv_cache_dtype.value == "float32" else f" + {cfg.kv_cache_dtype.value} KV cache"
    data = (
        f"calibrated on {result.calib_samples} x {result.calib_tokens // result.calib_samples} tokens"
        if result.calib_samples
        else "weights only (no calibration data needed)"
    )
    click.echo(
        f"quantized {result.config.architecture} to {cfg.qformat.value}{kv} -> {output} ({size:.1f} MiB): "
        f"{data} in {result.calib_seconds:.1f}s, {result.seconds:.1f}s in all"
    )
    note = int4_note(cfg, output, zero_points_possible=result.config.moe is None)
    if note is not None:
        click.echo(note, err=True)
