"""``trtbuild eval ENGINE_DIR|CKPT_DIR [--dataset NAME|PATH] [--windows N] [--seq-len L] [--json]``."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from ..config import EvalConfig
from .options import config_from_options, dataclass_options


@click.command("eval")
@click.argument("path", type=click.Path(path_type=Path))
@dataclass_options(EvalConfig)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (perplexity, tokens, ...)")
def eval_command(path: Path, as_json: bool, **options: object) -> None:
    """Perplexity of an engine (or of a checkpoint, built into a temporary engine) over non-overlapping windows
    of a dataset's evaluation split (disjoint from the calibration split that `trtbuild quantize` uses)."""
    from ..eval import evaluate

    cfg = config_from_options(EvalConfig, options)
    result = evaluate(path, cfg, progress=not as_json)
    if as_json:
        click.echo(json.dumps(asdict(result), sort_keys=True))
    else:
        click.echo(
            f"perplexity {result.perplexity:.4f} over {result.tokens} tokens ({result.windows} windows x "
            f"{result.seq_len}, {result.dataset} evaluation split) in {result.seconds:.1f}s"
        )
