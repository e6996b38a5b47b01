"""Back an onnxruntime session's weights with transparent huge pages (Linux; a no-op elsewhere).

A batch-1 decode step streams every weight matrix once (538 MB for SmolLM2-135M in float32): with 4 KB pages
that is a TLB miss every 4 KB; on 2 MB pages batch-1 decode is a few percent faster
(docs/decisions/huge-pages-weights-not-kv-cache.md). Linux's default THP mode, ``madvise``, backs memory with huge
pages only when asked, so ``OrtSession`` asks, twice:

- the native kernels' weights (``QLinear`` reads its packed codes in place every step) are read from the data
  file into one anonymous arena advised before its first write (``WeightArena``), and onnxruntime is handed
  them instead of mapping the file tensor by tensor (file pages it maps that way cannot be collapsed);
- what onnxruntime allocates while creating the ``InferenceSession`` (its prepacked float matrices): the session
  records the process's anonymous mappings before and advises the memory that appeared in between —
  ``MADV_HUGEPAGE``, then ``MADV_COLLAPSE`` (Linux 6.1+) to rewrite the populated pages now (~0.1-0.9 s for
  0.5 GB). ``malloc`` is first told to map each large block apart, so that those weights are new memory rather
  than a freed block reused.

The KV cache is allocated after that window and stays on small pages (huge pages there made the attention
kernel slower, and each first write of a 2 MB page cost 100+ us). Nothing changes numerically; a kernel without
THP or ``MADV_COLLAPSE`` leaves the pages as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import mmap
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

Range = tuple[int, int]  # [start, end) virtual addresses


def supported() -> bool:
    """Linux with transparent huge pages not switched off (``always`` or ``madvise``)."""
    try:
        return sys.platform == "linux" and "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def anonymous_ranges() -> list[Range]:
    """The writable anonymous memory of this process, sorted: ``/proc/self/maps`` lines without a path, and the
    ``[heap]`` (where ``malloc`` serves blocks below its mmap threshold)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if fields[1].startswith("rw") and (len(fields) == 5 or fields[5] == "[heap]"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return sorted(ranges)


def subtract(ranges: list[Range], old: list[Range]) -> list[Range]:
    """The parts of ``ranges`` not covered by ``old`` (both sorted, each free of overlaps)."""
    out, i = [], 0
    for start, end in ranges:
        while i < len(old) and old[i][1] <= start:
            i += 1
        j, cursor = i, start
        while j < len(old) and old[j][0] < end:
            if old[j][0] > cursor:
                out.append((cursor, old[j][0]))
            cursor = max(cursor, old[j][1])
            j += 1
        if cursor < end:
            out.append((cursor, end))
    return out


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once, with ``madvise``'s argument types set."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def map_large_allocations_apart() -> None:
    """Make ``malloc`` give every block of 1 MB or more its own mapping, from now on, in this process (glibc's
    ``M_MMAP_THRESHOLD``; elsewhere nothing happens). By default glibc raises that threshold to the size of each
    large block freed (up to 32 MB), so a second session's weights would reuse the first one's freed memory: old
    ranges that the window misses. Blocks of 1 MB+ are a decode step's weight matrices and the batch-sized
    arrays; a fresh mapping for each such array costs its page faults (~0.1 ms a MB), nothing a step notices."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, 1 << 20)


def advise_huge_pages(ranges: list[Range]) -> int:
    """Ask for the 2 MB-aligned interiors of ``ranges`` to be huge pages; returns the bytes advised (0 if the
    kernel refused all). Populated memory is collapsed now where the kernel can (``MADV_COLLAPSE``)."""
    libc, advised = _libc(), 0
    for start, end in ranges:
        lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if hi > lo and libc.madvise(lo, hi - lo, MADV_HUGEPAGE) == 0:
            libc.madvise(lo, hi - lo, MADV_COLLAPSE)  # fails on unpopulated parts and old kernels: harmless
            advised += hi - lo
    return advised


def huge_page_bytes(ranges: list[Range]) -> int:
    """Bytes on huge pages now in the mappings that overlap ``ranges`` (``AnonHugePages`` of ``/proc/self/smaps``;
    a mapping counts whole, so this is an upper bound for ``ranges`` alone)."""
    total, current = 0, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                current = (start, end)
            elif head == "AnonHugePages:" and current and any(s < current[1] and current[0] < e for s, e in ranges):
                total += int(line.split()[1]) * 1024
    return total


ARENA_LAYOUT = "native_weights.json"  # beside the engine's model file: WeightArena's input, written by the build


@dataclass(frozen=True)
class ArenaTensor:
    """One weight in a data file of the engine: ``length`` bytes at ``offset`` of ``location`` (relative to the
    model file's folder), holding a C-order array of ``dtype`` (numpy's name) and ``shape``."""

    name: str
    location: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]


def read_arena_layout(model_path: Path) -> list[ArenaTensor] | None:
    """The weights ``WeightArena`` holds for the engine at ``model_path``, from its build's ``native_weights.json``;
    None for an engine built before that file existed (``OrtSession`` then reads the graph: ``graph_arena_layout``)."""
    layout = model_path.with_name(ARENA_LAYOUT)
    if not layout.is_file():
        return None
    entries = json.loads(layout.read_text())["tensors"]
    return [ArenaTensor(**{**e, "shape": tuple(e["shape"])}) for e in entries]


def graph_arena_layout(model_path: Path) -> list[ArenaTensor]:
    """Where the weights of the engine's ``WEIGHT_OPS`` nodes lie in its external data, read from the graph at
    ``model_path`` with ``onnx`` (imported here only: the build writes this as ``native_weights.json``, so that
    the runtime needs no ``onnx``; an engine built before that file existed is read this way)."""
    import onnx
    from onnx import TensorProto, helper

    from ...kernels.library import WEIGHT_OPS

    model = onnx.load(str(model_path), load_external_data=False)
    external = {t.name: t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    names = {i for n in model.graph.node if (n.domain, n.op_type) in WEIGHT_OPS for i in n.input if i in external}
    layout = []
    for name in sorted(names):
        tensor = external[name]
        info = {e.key: e.value for e in tensor.external_data}
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).name
        offset, length = int(info.get("offset", 0)), int(info["length"])
        layout.append(ArenaTensor(name, info["location"], offset, length, dtype, tuple(tensor.dims)))
    return layout


def write_arena_layout(model_path: Path) -> None:
    """Write ``native_weights.json`` beside the engine's model file (``graph_arena_layout``: the build's part)."""
    text = json.dumps({"tensors": [asdict(t) for t in graph_arena_layout(model_path)]}, indent=1)
    model_path.with_name(ARENA_LAYOUT).write_text(text + "\n")


class WeightArena:
    """The weights of ``layout`` (the native ops' weights, ``read_arena_layout``) copied from the engine's data
    files into one anonymous mapping on huge pages, each tensor 64-byte aligned. onnxruntime would map every tensor
    of a data file separately (small pages that ``MADV_COLLAPSE`` cannot turn into huge ones: they are
    file-backed); ``values`` (zero-copy ``OrtValue`` views) go to ``SessionOptions.add_initializer`` instead, which
    makes onnxruntime use them rather than read the file, and the arena must outlive the session."""

    def __init__(self, model_path: Path, layout: list[ArenaTensor]) -> None:
        import onnxruntime as ort

        starts, size = [], 0
        for tensor in layout:
            starts.append(size)
            size += -(-tensor.length // 64) * 64
        self.memory = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if supported():
            self.memory.madvise(mmap.MADV_HUGEPAGE)  # before the first write: the pages fault in as 2 MB ones
        self.arrays: dict[str, np.ndarray] = {}
        view, files = memoryview(self.memory), {}
        folder = model_path.parent.resolve()
        try:
            for tensor, start in zip(layout, starts, strict=True):
                if tensor.location not in files:
                    file = (folder / tensor.location).resolve()
                    if folder not in file.parents:
                        raise OSError(f"external data {tensor.location!r} lies outside the engine directory")
                    files[tensor.location] = open(file, "rb")  # noqa: SIM115 (closed below)
                f = files[tensor.location]
                f.seek(tensor.offset)
                if f.readinto(view[start : start + tensor.length]) != tensor.length:
                    raise OSError(f"{tensor.location}: truncated external data for {tensor.name}")
                dtype = np.dtype(tensor.dtype)
                array = np.frombuffer(self.memory, dtype, tensor.length // dtype.itemsize, start)
                self.arrays[tensor.name] = array.reshape(tensor.shape)
        finally:
            for f in files.values():
                f.close()
        self.values = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in self.arrays.items()}
        self.nbytes = size
