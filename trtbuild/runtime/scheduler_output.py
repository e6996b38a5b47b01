"""``SchedulerOutput``: one step's plan, as ``Scheduler.schedule`` makes it and the engine loop reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .batch import StepBatch
from .prompt_logprobs import NO_ROWS, logits_rows
from .sequence import Sequence


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: ``scheduled[b]`` = (request b of the batch, its number of new tokens).

    Invariants: at most ``max_num_seqs`` entries, ``num_batched_tokens <= max_num_batched_tokens``, every count
    >= 1, and request b's block table covers positions up to ``num_computed_tokens + count``. Read it (and build
    the step) before ``update_from_output``, which advances the requests.
    """

    scheduled: list[tuple[Sequence, int]]
    # Rows of the step's logits to sample: requests whose new tokens reach their last token. A request in the middle
    # of a chunked prefill is computed but not sampled.
    sample_rows: list[int]
    preempted: list[Sequence]  # requests preempted while planning this step
    sliding_group: bool = False  # the model has a sliding KV-cache group: steps carry its block tables too
    # Request b -> offsets into its new tokens whose logits score its prompt tokens (prompt_logprobs.py); only the
    # requests with some. With any, request b's logits are these rows then its last token's (``logits_rows``).
    prompt_rows: dict[int, range] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sample_seqs(self) -> list[Sequence]:
        """The requests of ``sample_rows``, in the same order."""
        return [self.scheduled[b][0] for b in self.sample_rows]

    def part(self, rows: list[int]) -> SchedulerOutput:
        """The requests ``rows`` of this step as a step of their own (one engine call), sampling none."""
        prompt = {i: self.prompt_rows[b] for i, b in enumerate(rows) if b in self.prompt_rows}
        return SchedulerOutput([self.scheduled[b] for b in rows], [], [], self.sliding_group, prompt)

    def logits_ends(self) -> list[int]:
        """Where request b's rows of the step's logits end (its last token's row is the one before)."""
        ends, total = [], 0
        for b, (_, n) in enumerate(self.scheduled):
            total += len(logits_rows(self.prompt_rows.get(b, NO_ROWS), n)) if self.prompt_rows else 1
            ends.append(total)
        return ends

    def to_step_batch(self) -> StepBatch:
        """The engine inputs: each request's new tokens from position ``num_computed_tokens``, and its block table."""
        rows = None
        if self.prompt_rows:
            rows = [logits_rows(self.prompt_rows.get(b, NO_ROWS), n) for b, (_, n) in enumerate(self.scheduled)]
        return StepBatch.build(
            [seq.token_ids(seq.num_computed_tokens, seq.num_computed_tokens + n) for seq, n in self.scheduled],
            [seq.num_computed_tokens for seq, _ in self.scheduled],
            [seq.block_ids for seq, _ in self.scheduled],
            sliding_block_tables=[seq.sliding_block_ids for seq, _ in self.scheduled] if self.sliding_group else None,
            logits_rows=rows,
        )
