"""``trtbuild eval ENGINE_DIR|CKPT_DIR [--dataset NAME|PATH] [--windows N] [--seq-len L] [--json]``."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..config import BuildConfig, EvalConfig
from ..errors import TrtbuildError
from .options import config_from_options, dataclass_options

if TYPE_CHECKING:
    from ..eval import EvalResult


def evaluate(path: Path, cfg: EvalConfig, *, cache_dir: Path | None = None, progress: bool = False) -> EvalResult:
    """Perplexity of the engine directory or checkpoint directory at ``path`` (``progress``: a bar on a terminal).

    A checkpoint is first built into a temporary onnxruntime engine (``max_seq_len`` = ``cfg.seq_len``).
    """
    from ..artifacts.inspect import not_a_directory
    from ..eval import evaluate_engine

    if not path.is_dir():
        raise TrtbuildError(not_a_directory(path, "engine or checkpoint directory"))
    if (path / "runtime_config.json").is_file():
        return evaluate_engine(path, cfg, cache_dir=cache_dir, progress=progress)
    if (path / "config.json").is_file():
        from ..build import build_engine

        with tempfile.TemporaryDirectory(prefix="trtbuild-eval-") as tmp:
            build = BuildConfig(max_seq_len=cfg.seq_len, max_num_tokens=max(cfg.seq_len, 2048), max_batch_size=1)
            build_engine(path, Path(tmp) / "engine", build)
            return evaluate_engine(Path(tmp) / "engine", cfg, cache_dir=cache_dir, progress=progress)
    raise TrtbuildError(f"{path}: neither an engine directory (runtime_config.json) nor a checkpoint (config.json)")


@click.command("eval")
@click.argument("path", type=click.Path(path_type=Path))
@dataclass_options(EvalConfig)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (perplexity, tokens, ...)")
def eval_command(path: Path, as_json: bool, **options: object) -> None:
    """Perplexity of an engine (or of a checkpoint, built into a temporary engine) over non-overlapping windows
    of a dataset's evaluation split (disjoint from the calibration split that `trtbuild quantize` uses)."""
    cfg = config_from_options(EvalConfig, options)
    result = evaluate(path, cfg, progress=not as_json)
    if as_json:
        click.echo(json.dumps(asdict(result), sort_keys=True))
    else:
        click.echo(
            f"perplexity {result.perplexity:.4f} over {result.tokens} tokens ({result.windows} windows x "
            f"{result.seq_len}, {result.dataset} evaluation split) in {result.seconds:.1f}s"
        )
