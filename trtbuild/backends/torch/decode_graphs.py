"""Decode steps on padded, preallocated inputs, replayed as CUDA graphs on a GPU.

A pure decode step (every sequence brings one token, logits for each) of ``B`` sequences runs at the smallest
configured size ``P >= B``: the step's tensors are copied into static buffers of that size and the ``P - B``
padding sequences each hold one token at position 0 of the null block 0 (the block manager never hands block 0
out, and a block table reads only its sequence's own positions, so the padding's writes there are never read).
Invariant: every step rewrites every row of the buffers, the padding's included.
On CUDA the AOT-compiled step is captured once per size into a CUDA graph (on first use) and replayed, so a small
batch pays one graph launch instead of one launch per kernel plus the paged-attention op's Python calls. On the
CPU the same padded path runs without graphs (how the tests check the padding).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ...runtime.batch import StepBatch

log = logging.getLogger(__name__)


class DecodeGraphs:
    """Padded decode steps for the batch sizes ``sizes`` (sorted); CUDA graphs when ``device`` is CUDA."""

    def __init__(
        self,
        runner: Callable[..., Any],
        caches: list[torch.Tensor],
        sizes: Sequence[int],
        max_blocks: int,
        *,
        sliding: bool = False,
    ) -> None:
        self.runner, self.caches = runner, caches
        self.sliding = sliding  # the engine also takes the sliding layers' block tables (two KV-cache groups)
        self.sizes = sorted(set(sizes))
        self.max_blocks = max_blocks
        self.device = caches[0].device
        self.use_graphs = self.device.type == "cuda"
        self._static: dict[int, list[torch.Tensor]] = {}
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # size -> (CUDAGraph, its output)
        self.failed = False  # capture failed once: graphs are off, the padded path stays

    @property
    def replaying(self) -> bool:
        """Whether decode steps run as CUDA graphs: sizes configured, on CUDA, and no capture has failed."""
        return bool(self.sizes) and self.use_graphs and not self.failed

    def fits(self, batch: StepBatch) -> bool:
        """A pure decode step no larger than the largest size, whose block tables fit the static width."""
        return (
            bool(self.sizes)
            and batch.num_tokens == batch.num_seqs <= self.sizes[-1]
            and len(batch.logits_indices) == batch.num_seqs
            and batch.block_tables.shape[1] <= self.max_blocks
            and (not self.sliding or batch.sliding_block_tables is not None)
            and (batch.sliding_block_tables is None or batch.sliding_block_tables.shape[1] <= self.max_blocks)
        )

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits ``[B, vocab]`` of the decode step ``batch`` (``fits(batch)`` must hold)."""
        b = batch.num_seqs
        size = next(s for s in self.sizes if s >= b)
        static = self._buffers(size)
        ids, positions, tables, _, logits_idx = static[:5]
        # Every row is written: the padding rows too, which a larger batch of this size may have left holding a
        # finished sequence's token, position and blocks (its writes would land in blocks handed out since).
        ids.zero_()
        positions.zero_()
        ids[:b].copy_(torch.from_numpy(np.ascontiguousarray(batch.input_ids, dtype=np.int64)))
        positions[:b].copy_(torch.from_numpy(np.ascontiguousarray(batch.positions, dtype=np.int64)))
        pairs = [(tables, batch.block_tables)]
        if self.sliding and batch.sliding_block_tables is not None:
            pairs.append((static[5], batch.sliding_block_tables))
        for buffer, rows in pairs:
            buffer.zero_()
            buffer[:b, : rows.shape[1]].copy_(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)))
        logits_idx[:b].copy_(torch.from_numpy(np.ascontiguousarray(batch.logits_indices, dtype=np.int64)))
        if self.replaying:
            graph = self._graphs.get(size) or self._capture(size, static)
            if graph is not None:
                graph[0].replay()
                return graph[1][:b]
        with torch.inference_mode():
            return self._call(static)[:b]

    def _call(self, static: list[torch.Tensor]) -> torch.Tensor:
        """The runner on the static buffers: the five step tensors, the caches, then the sliding tables if any."""
        return self.runner(*static[:5], self.caches, *static[5:])

    def _buffers(self, size: int) -> list[torch.Tensor]:
        if size not in self._static:
            long = dict(dtype=torch.long, device=self.device)
            self._static[size] = [
                torch.zeros(size, **long),  # input_ids (padding: token 0)
                torch.zeros(size, **long),  # positions (padding: position 0)
                torch.zeros((size, self.max_blocks), **long),  # block tables (padding: the null block)
                torch.arange(size + 1, **long),  # query_start_loc: one token per sequence
                torch.arange(size, **long),  # logits_indices
            ]
            if self.sliding:  # the sliding layers' block tables (padding: the null block)
                self._static[size].append(torch.zeros((size, self.max_blocks), **long))
        return self._static[size]

    def _capture(self, size: int, static: list[torch.Tensor]) -> tuple[Any, torch.Tensor] | None:
        """Capture the step at ``size`` (after a warm-up run on a side stream); None (graphs off) on failure, with the
        caller's stream current again (``torch.cuda.graph`` leaves its capture stream current when the capture
        fails to end)."""
        caller = torch.cuda.current_stream()
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                self._call(static)  # warm-up: lazy initialisation outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph):
                out = self._call(static)
            self._graphs[size] = (graph, out)
            return self._graphs[size]
        except Exception as e:  # the padded path without graphs still runs; say why once
            torch.cuda.set_stream(caller)
            log.warning("CUDA graph capture of the decode step failed, running without graphs: %s", e)
            self.failed = True
            return None
