"""Huge pages for a session's weights (``backends/onnxruntime/huge_pages.py``): the range arithmetic, and that
Linux really backs memory that appeared in a window with 2 MB pages."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from trtbuild.backends.onnxruntime import huge_pages as hp

MB = 1 << 20


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
