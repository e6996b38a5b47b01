"""``trtbuild eval``: perplexity of an engine on held-out text (a checkpoint is built into a temporary engine first,
by ``trtbuild.cli.eval.evaluate``: this module does not build).

The text is the *evaluation* split of a named dataset (disjoint from the calibration split ``quantize`` uses) or
a user file; it is tokenized with the engine's ``tokenizer.json`` into one stream, cut into ``windows``
non-overlapping windows of ``seq_len`` tokens from its start. Each window is one prefill step through the paged
KV cache with logits for every position; token ``t + 1`` is scored from the logits at ``t``, so a window scores
``seq_len - 1`` tokens and ``perplexity = exp(total NLL / tokens)``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import EvalConfig, PerplexityGate, RuntimeConfig
from .errors import BuildError, TrtbuildError


@dataclass(frozen=True)
class EvalResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # scored tokens: windows * (seq_len - 1)
    windows: int
    seq_len: int
    dataset: str
    seconds: float


def eval_windows(engine_dir: Path, cfg: EvalConfig, cache_dir: Path | None = None) -> np.ndarray:
    """``[windows, seq_len]`` token ids of the evaluation text; a text too short for that many is refused."""
    from .calibration_data import Split, load_documents, tokenize_documents

    docs = load_documents(cfg.dataset, Split.EVALUATION, cache_dir=cache_dir)
    ids = tokenize_documents(engine_dir / "tokenizer.json", docs, cfg.windows * cfg.seq_len)
    n = min(cfg.windows, len(ids) // cfg.seq_len)
    if n < cfg.windows:
        raise TrtbuildError(
            f"{cfg.dataset}: the evaluation text has {len(ids)} tokens: {n} windows of {cfg.seq_len}, not "
            f"--windows {cfg.windows} (ask for at most {n}{'' if n else ', or lower --seq-len'})"
        )
    return np.asarray(ids[: n * cfg.seq_len], dtype=np.int64).reshape(n, cfg.seq_len)


def evaluate_engine(
    engine_dir: Path,
    cfg: EvalConfig,
    *,
    cache_dir: Path | None = None,
    progress: bool = False,
    unfinished: bool = False,
) -> EvalResult:
    """Perplexity of a built engine of any backend, opened with ``open_session`` with just the KV cache one window
    needs (``progress``: a bar of windows on stderr when it is a terminal; ``unfinished``: the engine a build is
    still writing, before its manifest, see ``open_session``)."""
    from .progress import progress as progress_bar
    from .runtime.batch import StepBatch
    from .runtime.kv_cache import bytes_per_block
    from .runtime.session import open_session

    start = time.perf_counter()
    if not (engine_dir / "runtime_config.json").is_file():
        raise TrtbuildError(f"{engine_dir}: not an engine directory (no runtime_config.json)")
    rc = RuntimeConfig.load(engine_dir)
    if cfg.seq_len > rc.build.max_seq_len or cfg.seq_len > rc.build.max_num_tokens:
        raise TrtbuildError(
            f"{engine_dir}: --seq-len {cfg.seq_len} exceeds the engine's max_seq_len "
            f"{rc.build.max_seq_len} / max_num_tokens {rc.build.max_num_tokens}"
        )
    windows = eval_windows(engine_dir, cfg, cache_dir)
    block = rc.build.kv_block_size
    blocks = list(range(1, math.ceil(cfg.seq_len / block) + 1))  # block 0 is the null block
    memory = (len(blocks) + 1) * bytes_per_block(rc.model, block)
    session = open_session(engine_dir, kv_cache_memory=memory, unfinished=unfinished)
    total = 0.0
    shown = None if progress else False
    for ids in progress_bar(windows, len(windows), "evaluating", "window", enabled=shown):
        logits = session.step(StepBatch.build([ids.tolist()], [0], [blocks], all_logits=True))
        total += _nll_sum(logits[:-1], ids[1:])
    tokens = windows.shape[0] * (cfg.seq_len - 1)
    nll = total / tokens
    return EvalResult(
        math.exp(nll), nll, tokens, int(windows.shape[0]), cfg.seq_len, cfg.dataset, time.perf_counter() - start
    )


def _nll_sum(logits: np.ndarray, targets: np.ndarray) -> float:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=-1))
    return float((lse - x[np.arange(len(targets)), targets]).sum())


@dataclass(frozen=True)
class GateResult:
    perplexity: float
    reference_perplexity: float
    increase_pct: float
    max_increase_pct: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def check_gate(engine_dir: Path, gate: PerplexityGate) -> GateResult:
    """Evaluate ``engine_dir`` (a build's, before its manifest is written) and the reference engine; raise
    ``BuildError`` when perplexity rose too far."""
    ref = evaluate_engine(gate.ref_engine, gate.eval)
    new = evaluate_engine(engine_dir, gate.eval, unfinished=True)
    increase = 100.0 * (new.perplexity / ref.perplexity - 1.0)
    result = GateResult(new.perplexity, ref.perplexity, increase, gate.max_ppl_increase)
    if increase > gate.max_ppl_increase:
        raise BuildError(
            f"accuracy gate failed: perplexity {new.perplexity:.3f} is {increase:+.2f}% vs the "
            f"reference's {ref.perplexity:.3f} (limit +{gate.max_ppl_increase:g}%); no engine written"
        )
    return result
