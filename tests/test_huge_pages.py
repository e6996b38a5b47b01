"""Huge pages for a session's weights (``backends/onnxruntime/huge_pages.py``): the range arithmetic, that Linux
really backs memory that appeared in a window with 2 MB pages, and that SmolLM2's logits do not change with them
(skipped with the reason where this machine cannot give huge pages: then both sessions would be the same)."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys

import pytest

from trtbuild.backends.onnxruntime import huge_pages as hp

MB = 1 << 20


def huge_pages_unavailable() -> str | None:
    """Why this machine cannot put memory on transparent huge pages, or None where it can: THP switched off
    (``[never]``) or absent, as ``huge_pages.supported()`` reads it, or the kernel refusing ``madvise``'s
    ``MADV_HUGEPAGE`` on a fresh 4 MB anonymous mapping, which is how a session asks."""
    if not hp.supported():
        mode = hp.THP_MODE.read_text().strip() if hp.THP_MODE.exists() else "absent"
        return f"no transparent huge pages on this machine ({hp.THP_MODE}: {mode})"
    region = mmap.mmap(-1, 4 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    advised = hp.advise_huge_pages([(start, start + 4 * MB)])
    region.close()
    return None if advised else "this kernel refuses madvise(MADV_HUGEPAGE) on anonymous memory"


NO_HUGE_PAGES = huge_pages_unavailable()


def test_subtract_keeps_only_what_is_new():
    old = [(10, 20), (30, 40)]
    assert hp.subtract([(0, 50)], old) == [(0, 10), (20, 30), (40, 50)]
    assert hp.subtract([(10, 20), (30, 45)], old) == [(40, 45)]  # a mapping that grew: only its new tail
    assert hp.subtract([(12, 18)], old) == []
    assert hp.subtract([(0, 5), (55, 60)], old) == [(0, 5), (55, 60)]
    assert hp.subtract([(15, 35)], old) == [(20, 30)]
    assert hp.subtract([(0, 8)], []) == [(0, 8)]


def kernel_version() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@pytest.mark.skipif(not hp.supported() or kernel_version() < (6, 1), reason="needs Linux THP and MADV_COLLAPSE")
def test_memory_that_appeared_in_the_window_goes_to_huge_pages():
    before = hp.anonymous_ranges()
    region = mmap.mmap(-1, 16 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.write(b"\1" * (16 * MB))  # populated, as a session's weights are
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    new = hp.subtract(hp.anonymous_ranges(), before)
    assert any(s <= start and start + 16 * MB <= e for s, e in new)
    mine = [(start, start + 16 * MB)]
    if "[madvise]" in hp.THP_MODE.read_text():
        assert hp.huge_page_bytes(mine) == 0  # small pages until asked
    assert hp.advise_huge_pages(mine) >= 14 * MB  # the 2 MB-aligned interior of 16 MB
    assert hp.huge_page_bytes(mine) >= 2 * MB
    assert region[:4] == b"\1\1\1\1" and region[-1:] == b"\1"  # the contents survive the collapse
    region.close()


HUGE_PAGES_CHECK = """
import sys
import numpy as np
from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.runtime.batch import StepBatch
batch = StepBatch.build([[1, 504, 3458, 28, 1790, 30]], [0], [[1, 2, 3]], all_logits=True)
session = OrtSession(sys.argv[1], kv_cache_memory=32 << 20)
assert session.huge_page_bytes > 400 << 20, session.huge_page_bytes  # the float32 weights, prepacked: 538 MB
logits = session.step(batch)
small = OrtSession(sys.argv[1], kv_cache_memory=32 << 20, huge_pages=False)
assert small.huge_page_bytes == 0
np.testing.assert_array_equal(small.step(batch), logits)
"""


@pytest.mark.slow
@pytest.mark.skipif(NO_HUGE_PAGES is not None, reason=f"{NO_HUGE_PAGES}: both sessions would be on small pages")
def test_huge_pages_change_no_logit(smollm2):
    """The weights on huge pages (the default where Linux allows it) give bit-identical logits. In a fresh
    process: here torch's freed memory would be reused for the weights, old memory that the session's window
    does not see (huge_pages.py)."""
    _, _, engine = smollm2
    done = subprocess.run([sys.executable, "-c", HUGE_PAGES_CHECK, str(engine)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
