"""``trtbuild build CKPT_DIR -o ENGINE_DIR --backend onnxruntime|tensorrt|torch [--recipe FILE]``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from ..config import Backend, BuildConfig, PerplexityGate, RuntimeConfig, TensorRTConfig, TorchConfig
from ..configio import from_dict
from .options import OutputPath, config_with_defaults, dataclass_options, load_recipe_option, recipe_option


@click.command()
@click.argument("ckpt_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "output", type=OutputPath(directory=True), required=True, help="engine directory")
@dataclass_options(BuildConfig)
@dataclass_options(TensorRTConfig)
@dataclass_options(TorchConfig)
@recipe_option
@click.option("--overwrite", is_flag=True, help="replace an existing output directory")
@click.option(
    "--accuracy-gate",
    "accuracy_gate",
    type=click.Path(path_type=Path),
    default=None,
    metavar="REF_ENGINE_DIR",
    help="evaluate the new engine against this reference engine (perplexity, flask_docs evaluation split: "
    "technical text of another domain than the default calibration; 8 x 512 tokens) and fail, leaving no "
    "engine, when it rose more than --max-ppl-increase",
)
@click.option(
    "--max-ppl-increase",
    "max_ppl_increase",
    type=float,
    default=1.0,
    show_default=True,
    metavar="PCT",
    help="largest allowed perplexity increase over the reference engine, in percent",
)
def build(
    ckpt_dir: Path,
    output: Path,
    recipe: Path | None,
    overwrite: bool,
    accuracy_gate: Path | None,
    max_ppl_increase: float,
    **options: object,
) -> None:
    """Build an engine directory from a checkpoint.

    With --recipe, the recipe's build, tensorrt and torch sections supply the defaults (and its backend, when all
    its targets share one; a torch target's device); flags given on the command line override them.
    """
    from ..build import build_engine
    from ..progress import Elapsed

    spec = load_recipe_option(recipe)
    defaults = None
    if spec is not None:
        backends = {t.backend for t in spec.targets}
        defaults = replace(spec.build, backend=backends.pop()) if len(backends) == 1 else spec.build
    cfg = config_with_defaults(BuildConfig, options, defaults)
    trt_defaults = spec.tensorrt if spec is not None and cfg.backend is Backend.TENSORRT else None
    trt = config_with_defaults(TensorRTConfig, options, trt_defaults)
    torch_defaults = None
    if spec is not None and cfg.backend is Backend.TORCH:
        devices = [t for t in spec.targets if t.backend is Backend.TORCH]
        torch_defaults = spec.torch_for(devices[0]) if len(devices) == 1 else spec.torch
    torch_cfg = config_with_defaults(TorchConfig, options, torch_defaults)
    gate = None
    if accuracy_gate is not None:
        gate = from_dict(PerplexityGate, {"ref_engine": str(accuracy_gate), "max_ppl_increase": max_ppl_increase})
    with Elapsed(f"building {cfg.backend.value} engine"):
        result = build_engine(ckpt_dir, output, cfg, overwrite=overwrite, gate=gate, tensorrt=trt, torch=torch_cfg)
    built = RuntimeConfig.load(output).build.max_seq_len
    if built < cfg.max_seq_len:  # capped by the model's position table
        click.echo(
            f"note: max_seq_len {cfg.max_seq_len} is more than the model's {built} positions "
            f"(max_position_embeddings): the engine takes sequences of up to {built} tokens",
            err=True,
        )
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    plugin_nodes = result.portable_op_counts.get("trtbuild::PagedAttention", 0)
    moe_nodes = result.portable_op_counts.get("trtbuild::MoE", 0)
    click.echo(
        f"built {cfg.backend.value} engine -> {output} in {result.seconds:.1f}s "
        f"(portable graph: {plugin_nodes} PagedAttention nodes" + (f", {moe_nodes} MoE nodes)" if moe_nodes else ")")
    )
    if result.accuracy_gate is not None:
        g = result.accuracy_gate
        click.echo(
            f"accuracy gate passed: perplexity {g['perplexity']:.3f} vs {g['reference_perplexity']:.3f} "
            f"({g['increase_pct']:+.2f}%, limit +{g['max_increase_pct']:g}%)"
        )
