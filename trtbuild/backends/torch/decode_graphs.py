"""Decode steps on padded, preallocated inputs, replayed as CUDA graphs on a GPU.

A pure decode step (every sequence brings one token, logits for each) of ``B`` sequences runs at the smallest
configured size ``P >= B``: the step's tensors are copied into static buffers of that size (``PaddedInputs``, one
copy a step) and the ``P - B`` padding sequences each hold one token at position 0 of the null block 0 (the block
manager never hands block 0 out, and a block table reads only its sequence's own positions, so the padding's
writes there are never read).
On CUDA the compiled step is captured once per size into a CUDA graph (on first use; all sizes share one memory
pool) and replayed, so a small batch pays one graph launch instead of one launch per kernel plus the
paged-attention op's Python calls. On the CPU the same padded path runs without graphs (how the tests check the
padding).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ...runtime.batch import StepBatch

log = logging.getLogger(__name__)


class PaddedInputs:
    """One padded size's step inputs: ``input_ids [P]``, ``positions [P]``, ``block_tables [P, M]``,
    ``query_start_loc [P + 1]``, ``logits_indices [P]`` (and the sliding layers' tables ``[P, M]``), all views of
    one int64 tensor on the device, which a CUDA graph captured once reads at fixed addresses.

    A step is written on the host into a mirror of that tensor (pinned memory on CUDA) and sent in one asynchronous
    copy, instead of a blocking copy per tensor. Invariants: every step rewrites every row, the padding's included
    (token 0 at position 0 of the null block: a larger batch of this size may have left a finished sequence's rows
    there, whose writes would land in blocks handed out since); ``query_start_loc`` is ``0..P`` (one token each),
    written once; the host mirror is not written again before its last copy has been read (``_sent``)."""

    def __init__(self, size: int, max_blocks: int, sliding: bool, device: torch.device) -> None:
        self.size, self.max_blocks = size, max_blocks
        widths = [size, size, size * max_blocks, size + 1, size] + ([size * max_blocks] if sliding else [])
        # each part starts 16 bytes in (an even number of int64s): Inductor assumes the alignment its inputs had
        # when compiled, and an AOTInductor package copies a misaligned input before every call
        self.starts = np.cumsum([0, *(w + w % 2 for w in widths)])
        self.ends = self.starts[:-1] + widths
        cuda = device.type == "cuda"
        self.host = torch.zeros(int(self.starts[-1]), dtype=torch.long, pin_memory=cuda)
        self.on_device = self.host.to(device) if cuda else self.host
        self._sent = torch.cuda.Event() if cuda else None
        self.tensors = [self.on_device[a:b] for a, b in zip(self.starts[:-1], self.ends, strict=True)]
        self.tensors[2] = self.tensors[2].view(size, max_blocks)
        if sliding:
            self.tensors[5] = self.tensors[5].view(size, max_blocks)
        host = self.host.numpy()
        host[self.starts[3] : self.ends[3]] = np.arange(size + 1)  # query_start_loc
        host[self.starts[4] : self.ends[4]] = np.arange(size)  # logits_indices (padding rows: their own)
        if cuda:
            self.on_device.copy_(self.host)

    def _part(self, host: np.ndarray, index: int) -> np.ndarray:
        part = host[self.starts[index] : self.ends[index]]
        return part.reshape(self.size, self.max_blocks) if index in (2, 5) else part

    def fill(self, batch: StepBatch) -> None:
        """Write ``batch`` (``num_seqs <= size`` one-token sequences) into every row, then send it to the device."""
        if self._sent is not None:
            self._sent.synchronize()  # the last copy has read the host mirror
        b = batch.num_seqs
        host = self.host.numpy()
        tables = [(2, batch.block_tables)] + ([(5, batch.sliding_block_tables)] if len(self.tensors) > 5 else [])
        for index, rows in [(0, batch.input_ids), (1, batch.positions), (4, batch.logits_indices)]:
            part = self._part(host, index)
            part[:b] = rows
            part[b:] = 0 if index < 4 else np.arange(b, self.size)
        for index, rows in tables:
            part = self._part(host, index)
            part[:] = 0
            if rows is not None:
                part[:b, : rows.shape[1]] = rows
        if self._sent is not None:
            self.on_device.copy_(self.host, non_blocking=True)
            self._sent.record()


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
        self._static: dict[int, PaddedInputs] = {}
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # size -> (CUDAGraph, its output)
        # One memory pool for every size's graph (vLLM's): a capture reuses what earlier captures freed (their
        # intermediates), never an output ``_graphs`` keeps alive. So one size's output may lie in another size's
        # intermediates: the logits ``run`` returns are valid until the next replay of any size (callers consume
        # or copy a step's logits before the next step). Replays never overlap: one stream, one step at a time.
        self._pool: Any = None
        # Sizes that run the padded path without a graph: one whose capture failed after others' succeeded (e.g.
        # out of memory), or every size when the first capture failed (the step itself cannot be captured).
        self._no_graph: set[int] = set()

    @property
    def replaying(self) -> bool:
        """Whether decode steps run as CUDA graphs: on CUDA, at some configured size whose capture has not failed."""
        return self.use_graphs and not self._no_graph.issuperset(self.sizes)

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
        """Logits ``[B, vocab]`` of the decode step ``batch`` (``fits(batch)`` must hold); a view of a graph's
        output when replayed: valid until the next step."""
        b = batch.num_seqs
        size = next(s for s in self.sizes if s >= b)
        inputs = self._inputs(size)
        inputs.fill(batch)
        if self.use_graphs and size not in self._no_graph:
            graph = self._graphs.get(size) or self._capture(size, inputs.tensors)
            if graph is not None:
                graph[0].replay()
                return graph[1][:b]
        with torch.inference_mode():
            return self._call(inputs.tensors)[:b]

    def _call(self, static: list[torch.Tensor]) -> torch.Tensor:
        """The runner on the static buffers: the five step tensors, the caches, then the sliding tables if any."""
        return self.runner(*static[:5], self.caches, *static[5:])

    def _inputs(self, size: int) -> PaddedInputs:
        if size not in self._static:
            self._static[size] = PaddedInputs(size, self.max_blocks, self.sliding, self.device)
        return self._static[size]

    def _capture(self, size: int, static: list[torch.Tensor]) -> tuple[Any, torch.Tensor] | None:
        """Capture the step at ``size`` (after a warm-up run on a side stream); None on failure, with the caller's
        stream current again (``torch.cuda.graph`` leaves its capture stream current when the capture fails to
        end). A first capture that fails turns graphs off; a later one only its own size."""
        caller = torch.cuda.current_stream()
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                self._call(static)  # warm-up: lazy initialisation outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
                out = self._call(static)
            self._pool = self._pool or graph.pool()
            self._graphs[size] = (graph, out)
            return self._graphs[size]
        except Exception as e:  # the padded path without graphs still runs; say why once
            torch.cuda.set_stream(caller)
            if self._graphs:  # others captured: this size's own trouble (e.g. its larger buffers did not fit)
                log.warning("CUDA graph capture of the decode step at batch size %d failed, that size runs "
                            "without a graph: %s", size, e)  # fmt: skip
                self._no_graph.add(size)
            else:  # the first capture: the step itself cannot be captured
                log.warning("CUDA graph capture of the decode step failed, running without graphs: %s", e)
                self._no_graph.update(self.sizes)
            return None
