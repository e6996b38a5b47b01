"""One linear layer on onnxruntime's CPU kernels, and an engine's linears alone: milliseconds and read bandwidth.

    .venv/bin/python benchmarks/cpu_linear.py [--shapes 576x960,576x3072,1536x576,576x49152] [--rows 1,64]
        [--blocks 16,32,64] [--bits 8|4] [--native] [--threads 2]
    .venv/bin/python benchmarks/cpu_linear.py --library OLD.so NEW.so [--rows 16,64,2048] [--copies 4]  # QLinear A/B
    .venv/bin/python benchmarks/cpu_linear.py --engine ENGINE_DIR   # the engine's matrix products, cut out
    .venv/bin/python benchmarks/cpu_linear.py --gguf [--shapes ...] [--rows 1,64] [--library X.so]  # GGUF's forms

The first form times, per ``KxN`` shape and row count, a float32 ``MatMul`` (MLAS) and ``MatMulNBits`` with 8-bit
(``--bits 4``: 4-bit) weights at each activation block size (accuracy level 4: int8 activations per block, as
trtbuild's quantized engines ran them before ``QLinear``) and with ``--native`` trtbuild's ``QLinear`` (int8 per
token and per block; int4 with groups of each block size), each over ``--copies`` copies of the weight (30, as the
layers of a model) so that it streams from DRAM; it prints the median time per product and the weight bytes read per
second. With ``--library`` it times only ``QLinear``, once per given build of the native library (flags as in
``trtbuild/kernels/library.py``; e.g. ``-mno-amx-tile`` for the VNNI loop on an AMX CPU), the
builds' sessions in turn for each shape and row count, their workers not spinning between calls. The second form
takes an engine's onnxruntime-optimized graph, keeps only its ``MatMul`` / ``MatMulNBits`` / ``MatMulInteger`` /
``QLinear`` nodes with their real weights (each fed a random input of its width) and times one pass over all of
them next to one engine step of batch 1: what the step costs beyond its matrix products.
benchmarks/results/2026-12-02-cpu2-where-the-time-goes.md has figures. Takes about a minute.
"""

from __future__ import annotations

import argparse
import os

# numpy's OpenBLAS workers, once woken, spin on the two cores the timed kernels need (seen in perf as
# blas_thread_server, and as 10-20% swings in single runs)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OUTPUT_TYPES = {
    "MatMul": TensorProto.FLOAT,
    "MatMulNBits": TensorProto.FLOAT,
    "MatMulInteger": TensorProto.INT32,
    "QLinear": TensorProto.FLOAT,
}
LINEAR_OPS = tuple(OUTPUT_TYPES)


def _median_ms(session: ort.InferenceSession, feeds: dict, reps: int) -> float:
    for _ in range(3):
        session.run(None, feeds)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _options(threads: int) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return opts


def linear_model(k: int, n: int, copies: int, block: int | None, bits: int = 8) -> onnx.ModelProto:
    """``copies`` independent products of one input: float32 ``MatMul`` (block None) or ``bits``-bit ``MatMulNBits``."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    for i in range(copies):
        if block is None:
            inits.append(numpy_helper.from_array((rng.standard_normal((k, n)) * 0.02).astype(np.float32), f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]))
            continue
        codes = rng.integers(0, 256, (n, k // block, block * bits // 8), dtype=np.uint8)
        scales = (rng.random(n * (k // block)) * 0.01).astype(np.float32)
        inits += [numpy_helper.from_array(codes, f"w{i}"), numpy_helper.from_array(scales, f"s{i}")]
        nodes.append(
            helper.make_node("MatMulNBits", ["x", f"w{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                             K=k, N=n, bits=bits, block_size=block, accuracy_level=4)
        )  # fmt: skip
    graph = helper.make_graph(
        nodes, "linears", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", n]) for i in range(copies)], inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _qlinear_ms(model: bytes, library: str, args: argparse.Namespace, feeds: dict) -> float:
    """Median ms of ``model`` (``QLinear`` nodes) on the native library ``library``; with several ``--library``
    builds in one process, their workers do not spin between calls (so that one build's idle pool does not slow
    the other's)."""
    opts = _options(args.threads)
    opts.register_custom_ops_library(library)
    if args.library and len(args.library) > 1:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    return _median_ms(session, feeds, args.reps)


def native_model(
    k: int, n: int, copies: int, block: int, bits: int, group: int | None = None, offsets: bool = False
) -> onnx.ModelProto:
    """``copies`` products on trtbuild's native ``QLinear`` (int8: per channel, activation blocks of ``block``;
    int4: groups and activation blocks of ``block``; ``group``: that weight group, activation blocks of ``block``;
    ``offsets``: unsigned codes and a float offset per group, as GGUF's Q4_1 / K-quants)."""
    from trtbuild.backends.onnxruntime.build.native_linear import ZERO_POINT, pack_weight, pad_scales, qlinear_node

    rng = np.random.default_rng(0)
    inits, nodes = [], []
    group = group or (k if bits == 8 else block)
    for i in range(copies):
        codes = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (k, n)).astype(np.int8)
        scales = (rng.random((-(-k // group), n)) * 0.01).astype(np.float32)
        inits += [numpy_helper.from_array(pack_weight(codes, bits), f"w{i}.packed"),
                  numpy_helper.from_array(pad_scales(scales), f"w{i}.scales")]  # fmt: skip
        if offsets:  # the stored codes read as unsigned: c + ZERO_POINT[bits]
            inits.append(numpy_helper.from_array(pad_scales(-ZERO_POINT[bits] * scales), f"w{i}.offsets"))
        node = qlinear_node(f"w{i}", "x", f"y{i}", k=k, n=n, bits=bits, group=group, block=block, offsets=offsets)
        nodes.append(node)
    graph = helper.make_graph(
        nodes, "linears", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", n]) for i in range(copies)], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("trtbuild.cpu", 1)])


# GGUF block types as ``QLinear`` runs them (convert/readers.py): (bits, group, offsets, bytes a weight read)
GGUF_FORMS = {
    "Q8_0, Q5_0": (8, 32, False, 1 + 4 / 32),
    "Q6_K, Q3_K": (8, 16, False, 1 + 4 / 16),
    "Q5_K": (8, 32, True, 1 + 8 / 32),
    "Q2_K, fused mixed": (8, 16, True, 1 + 8 / 16),
    "Q4_0": (4, 32, False, 0.5 + 4 / 32),
    "Q4_1, Q4_K": (4, 32, True, 0.5 + 8 / 32),
}


def gguf_table(args: argparse.Namespace) -> None:
    """Per shape and row count, a float32 ``MatMul`` and ``QLinear`` in each GGUF block form (on each ``--library``
    build, else this checkout's): ms and GB/s read, scales and offsets counted."""
    from trtbuild.kernels.library import library_path

    print(f"{args.threads} threads, {args.copies} copies of each weight, median of {args.reps}")
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        copies = max(2, min(args.copies, (1 << 30) // (k * n * 4)))
        for rows in args.rows:
            x = {"x": np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)}
            session = ort.InferenceSession(
                linear_model(k, n, copies, None).SerializeToString(), _options(args.threads),
                providers=["CPUExecutionProvider"],
            )  # fmt: skip
            ms = _median_ms(session, x, args.reps) / copies
            cells = [f"float32 {ms:.3f} ms ({k * n * 4 / ms / 1e6:.1f} GB/s)"]
            for name, (bits, group, offsets, width) in GGUF_FORMS.items():
                model = native_model(k, n, copies, group, bits, group, offsets).SerializeToString()
                for library in args.library or [str(library_path())]:
                    ms = _qlinear_ms(model, library, args, x) / copies
                    build = f" [{Path(library).name}]" if args.library else ""
                    cells.append(f"{name}{build} {ms:.3f} ms ({k * n * width / ms / 1e6:.1f} GB/s)")
            print(f"{k}x{n}, {rows} row(s): " + "; ".join(cells), flush=True)


def shapes_table(args: argparse.Namespace) -> None:
    print(f"{args.threads} threads, {args.copies} copies of each weight, median of {args.reps}")
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        copies = max(2, min(args.copies, (1 << 30) // (k * n * 4)))  # at most ~1 GB of float weights
        for rows in args.rows:
            x = {"x": np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)}
            cells = []
            for block in [] if args.library else [None, *[b for b in args.blocks if k % b == 0]]:
                session = ort.InferenceSession(
                    linear_model(k, n, copies, block, args.bits).SerializeToString(), _options(args.threads),
                    providers=["CPUExecutionProvider"],
                )  # fmt: skip
                ms = _median_ms(session, x, args.reps) / copies
                width = 4 if block is None else args.bits / 8
                name = "float32 MatMul" if block is None else f"MatMulNBits int{args.bits}/{block}"
                cells.append(f"{name} {ms:.3f} ms ({k * n * width / ms / 1e6:.1f} GB/s)")
            if args.native:
                from trtbuild.kernels.library import library_path

                libraries = args.library or [str(library_path())]
                per_token = [k] if args.bits == 8 else []  # int8 per token: one block per row
                for block in [*per_token, *[b for b in args.blocks if b % 8 == 0]]:
                    model = native_model(k, n, copies, block, args.bits).SerializeToString()
                    for library in libraries:
                        ms = _qlinear_ms(model, library, args, x) / copies
                        label = "per token" if block == k else str(block)
                        gbps = k * n * args.bits / 8 / ms / 1e6
                        build = f" [{Path(library).name}]" if args.library else ""
                        cells.append(f"QLinear{build} int{args.bits}/{label} {ms:.3f} ms ({gbps:.1f} GB/s)")
            print(f"{k}x{n}, {rows} row(s): " + "; ".join(cells), flush=True)


def engine_linears(args: argparse.Namespace) -> None:
    from trtbuild.backends.onnxruntime.session import OrtSession
    from trtbuild.kernels.library import library_path
    from trtbuild.runtime.batch import StepBatch

    engine = Path(args.engine)
    with tempfile.TemporaryDirectory(prefix="trtbuild-cpu-linear-") as tmp:
        opts = _options(args.threads)
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.data")
        opts.register_custom_ops_library(str(library_path()))
        ort.InferenceSession(
            str(engine / "engines/onnxruntime-cpu/model.onnx"), opts, providers=["CPUExecutionProvider"]
        )
        model = onnx.load(str(Path(tmp) / "opt.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type in LINEAR_OPS and n.input[1] in inits]
    feeds, new_nodes, used = {}, [], set()
    rng = np.random.default_rng(0)
    for i, node in enumerate(nodes):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        width = attrs["K"] if node.op_type == "MatMulNBits" else attrs["in_features"] if node.op_type == "QLinear" \
            else int(inits[node.input[1]].dims[0])  # fmt: skip
        dtype = np.uint8 if node.op_type == "MatMulInteger" else np.float32
        name = f"x_{node.op_type}_{width}"
        if name not in feeds:
            feeds[name] = rng.integers(0, 255, (1, width)).astype(dtype) if dtype == np.uint8 else \
                rng.standard_normal((1, width)).astype(dtype)  # fmt: skip
        clone = helper.make_node(node.op_type, [name, *node.input[1:]], [f"y{i}"], domain=node.domain)
        clone.attribute.extend(node.attribute)
        new_nodes.append(clone)
        used.update(i for i in node.input[1:] if i)
    graph = helper.make_graph(
        new_nodes, "linears",
        [helper.make_tensor_value_info(k, TensorProto.UINT8 if v.dtype == np.uint8 else TensorProto.FLOAT, [1, None])
         for k, v in feeds.items()],
        [helper.make_tensor_value_info(f"y{i}", OUTPUT_TYPES[n.op_type], None) for i, n in enumerate(new_nodes)],
        [inits[name] for name in sorted(used) if name in inits],
    )  # fmt: skip
    cut = helper.make_model(graph, opset_imports=list(model.opset_import))
    opts = _options(args.threads)
    opts.register_custom_ops_library(str(library_path()))
    session = ort.InferenceSession(cut.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    linears = _median_ms(session, feeds, args.reps)
    del session
    step = OrtSession(engine, kv_cache_memory=256 << 20, num_threads=args.threads)
    prompt = rng.integers(100, 20000, 128).tolist()
    blocks = list(range(1, 20))
    step.step(StepBatch.build([prompt], [0], [blocks]))
    times = []
    for i in range(args.reps):
        batch = StepBatch.build([[5]], [128 + i], [blocks])
        t = time.perf_counter()
        step.step(batch)
        times.append(time.perf_counter() - t)
    kinds = sorted({n.op_type for n in nodes})
    step_ms = 1e3 * statistics.median(times)
    print(f"{engine}: {len(nodes)} matrix products ({', '.join(kinds)}) alone {linears:.2f} ms; "
          f"a batch-1 decode step at context ~{128 + args.reps // 2} {step_ms:.2f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes", type=lambda s: s.split(","), default=["576x960", "576x3072", "1536x576", "576x49152"]
    )
    parser.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 64])
    parser.add_argument("--blocks", type=lambda s: [int(v) for v in s.split(",")], default=[16, 32, 64])
    parser.add_argument("--bits", type=int, choices=[4, 8], default=8, help="MatMulNBits weight bits")
    parser.add_argument("--native", action="store_true", help="also time trtbuild's native QLinear")
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--engine", help="time this engine's matrix products alone, next to its decode step")
    parser.add_argument("--gguf", action="store_true", help="time QLinear in each GGUF block form (GGUF_FORMS)")
    parser.add_argument(
        "--library", nargs="+", help="time QLinear alone on each of these builds of the native library (an A/B)"
    )
    args = parser.parse_args()
    args.native = args.native or bool(args.library)
    if args.engine:
        engine_linears(args)
    elif args.gguf:
        gguf_table(args)
    else:
        shapes_table(args)


if __name__ == "__main__":
    main()
