"""One scheduled step through the session: its engine calls (``split_step``), the logits rows it samples, and the
rows that score prompt tokens (``prompt_logprobs.py``), handed to the caller on the host."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .engine_session import EngineSession, StepSampler
from .prompt_logprobs import to_host
from .scheduler_output import SchedulerOutput
from .step_shaping import split_step

# Called with (request b of the step, the float32 host logits of its ``SchedulerOutput.prompt_rows[b]``).
PromptRowsSink = Callable[[int, np.ndarray], None]


def run_step(
    session: EngineSession, sampler: StepSampler, out: SchedulerOutput, on_prompt_rows: PromptRowsSink
) -> tuple[Any, int]:
    """(the logits of ``out.sample_rows``, in that order and where the session keeps them, or None when no row is
    sampled; the number of engine calls). Each request's prompt-logprob rows go to ``on_prompt_rows`` as its call
    returns."""
    groups = split_step([n for _, n in out.scheduled])
    if len(groups) == 1 and not out.prompt_rows:
        logits = session.step_logits(out.to_step_batch())
        if len(out.sample_rows) == len(out.scheduled):  # every row (sample_rows is ascending): no copy
            return logits, 1
        return (logits[out.sample_rows] if out.sample_rows else None), 1
    sampled, parts, order = set(out.sample_rows), [], []
    for group in groups:
        part = out.part(group)
        logits = session.step_logits(part.to_step_batch())
        ends = part.logits_ends()
        for i, rows in part.prompt_rows.items():
            start = ends[i - 1] if i else 0  # a request's prompt rows come first among its rows
            on_prompt_rows(group[i], to_host(logits[start : start + len(rows)]))
        rows = [ends[i] - 1 for i, b in enumerate(group) if b in sampled]
        if rows:
            parts.append(logits[rows])
            order += [b for b in group if b in sampled]
    if not parts:
        return None, len(groups)
    where = {b: i for i, b in enumerate(order)}
    return sampler.join(parts)[[where[b] for b in out.sample_rows]], len(groups)
