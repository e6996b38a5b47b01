"""Step shaping: which sequences of a scheduled step share one engine call.

The onnxruntime lowering of paged attention pads a call to ``[num_seqs, longest chunk]`` queries, so a step mixing
long prefill chunks with decodes runs as several calls whose padded size stays within ``PAD_RATIO`` x its tokens
+ ``PAD_SLACK`` (``docs/runner.md``, "Step shaping"). The calls of a step are independent: no request appears twice.
"""

from __future__ import annotations

from collections.abc import Sequence

PAD_RATIO = 1.25
PAD_SLACK = 64


def split_step(chunk_lens: Sequence[int]) -> list[list[int]]:
    """Group a step's sequences (by their new-token counts) into engine calls; returns indices per call.

    Longest chunks first; a sequence joins the current call while ``calls x longest <= PAD_RATIO x tokens +
    PAD_SLACK``. Decodes (1 token) therefore share one call and each long prefill chunk gets its own.
    """
    groups: list[list[int]] = []
    tokens = 0
    for b in sorted(range(len(chunk_lens)), key=lambda b: -chunk_lens[b]):
        n = chunk_lens[b]
        if groups and (len(groups[-1]) + 1) * chunk_lens[groups[-1][0]] <= PAD_RATIO * (tokens + n) + PAD_SLACK:
            groups[-1].append(b)
            tokens += n
        else:
            groups.append([b])
            tokens = n
    return groups
