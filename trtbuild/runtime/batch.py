"""One engine step's inputs: a ragged batch of sequences, each contributing one or more new tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepBatch:
    """Flattened inputs of one step (the ``trtbuild::PagedAttention`` metadata plus token ids).

    Invariants: ``query_start_loc`` starts at 0, is strictly increasing and ends at ``len(input_ids)``; the
    positions of a sequence's tokens are consecutive; ``block_tables`` row b covers every position of sequence b
    (padded with 0, the null block; with a KV window, entries of the blocks wholly before the window of the
    sequence's first new token are 0 too: the paged-attention op reads no such block);
    ``logits_indices`` are rows of ``input_ids`` whose logits the step returns (usually each sequence's last token).
    ``sliding_block_tables``: for a model of both attention kinds (``ModelConfig.has_sliding_kv_group``) the sliding
    layers' tables (``Sequence.sliding_block_ids``), laid out as ``block_tables`` (same rows and positions, entries
    before each window the null block 0); None for a model of one kind, whose engine has no such input.
    """

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int64 [B + 1]
    block_tables: np.ndarray  # int64 [B, M]
    logits_indices: np.ndarray  # int64 [N]
    sliding_block_tables: np.ndarray | None = None  # int64 [B, M'], or None (one KV-cache group)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.query_start_loc.shape[0] - 1)

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        start_positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        *,
        all_logits: bool = False,
        sliding_block_tables: Sequence[Sequence[int]] | None = None,
        logits_rows: Sequence[Sequence[int]] | None = None,
    ) -> StepBatch:
        """Assemble a step from per-sequence new tokens, the position of each one's first new token, and block ids
        (and the sliding layers' block ids, for a model of both attention kinds).

        Returns logits for each sequence's last token, or for every token when ``all_logits``, or for the rows
        ``logits_rows[b]`` of sequence b (ascending offsets into its new tokens), sequence by sequence.
        """
        lens = [len(t) for t in token_ids]
        if not lens or min(lens) == 0:
            raise ValueError("every sequence in a step needs at least one token")
        qsl = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        ids = np.fromiter((t for seq in token_ids for t in seq), dtype=np.int64, count=int(qsl[-1]))
        pos = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(start_positions, lens, strict=True)])
        tables = _padded(block_tables, len(lens))
        sliding = None if sliding_block_tables is None else _padded(sliding_block_tables, len(lens))
        if logits_rows is not None:
            if len(logits_rows) != len(lens) or any(
                r and not 0 <= r[0] <= r[-1] < n for r, n in zip(logits_rows, lens, strict=True)
            ):
                raise ValueError("logits_rows needs one list of offsets within its new tokens per sequence")
            logits_idx = np.fromiter((qsl[b] + r for b, rows in enumerate(logits_rows) for r in rows), dtype=np.int64)
        else:
            logits_idx = np.arange(qsl[-1], dtype=np.int64) if all_logits else qsl[1:] - 1
        return cls(ids, pos, qsl, tables, logits_idx, sliding)


def _padded(rows: Sequence[Sequence[int]], num_seqs: int) -> np.ndarray:
    """Block tables as one int64 array, rows padded with the null block 0 (at least one column)."""
    if len(rows) != num_seqs:
        raise ValueError(f"{len(rows)} block tables for {num_seqs} sequences")
    width = max(1, max(len(b) for b in rows))
    tables = np.zeros((num_seqs, width), dtype=np.int64)
    for i, row in enumerate(rows):
        tables[i, : len(row)] = row
    return tables
