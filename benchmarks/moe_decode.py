"""Batch-1 decode step time of a mixture-of-experts model against a dense model of the same active parameters.

    .venv/bin/python benchmarks/moe_decode.py [--hidden 1024] [--layers 8] [--experts 8] [--top-k 2]
        [--expert-width 1024] [--vocab 32000] [--context 128] [--rounds 9] [--steps 16] [--lowered] [--int8]
        [--int4] [--group-size 128] [--keep DIR]

Two random-init float32 models of the same shape are made with transformers (no download): a Mixtral of
``--experts`` experts of ``--expert-width``, ``--top-k`` routed per token, and a Llama whose dense MLP is
``--top-k`` x ``--expert-width`` wide, so each token multiplies by the same number of weights in both (the router's
E x H is the difference). Each is converted and built as a default onnxruntime engine (native attention and, for the
Mixtral, the native ``MoE`` kernel) and, with ``--lowered``, also with standard ops only (the Mixtral's experts then
dense: every expert on every token). ``--int8`` quantizes both checkpoints first (``trtbuild quantize --qformat
int8_wo``: the dense model's linears through modelopt, run by ``QLinear``; the MoE model's experts int8 per row on
``QLinear``'s products inside the ``MoE`` kernel, its attention and head as the dense model's); ``--int4`` likewise
to ``int4_wo`` (blocks of ``--group-size``: the dense model's linears int4 in ``QLinear``, the MoE model's experts
int4 in the ``MoE`` kernel, on ``QLinear``'s products too; both heads int8, as every format's). With both, the four
quantized engines run side by side. A sequence of ``--context`` tokens is prefilled, then each round times
``--steps`` batch-1 decode steps per engine (``OrtSession.step``, no runner), engines interleaved round by round so
that the machine's drift hits all alike.
Prints each engine's median step time over rounds (of each round's median) and the MoE / dense ratio of those
medians, with the median and range of the rounds' own ratios; the target is <= 1.3 (an MoE step should cost what its
active parameters cost).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from trtbuild.backends.onnxruntime.session import OrtSession
from trtbuild.build import build_engine
from trtbuild.config import BuildConfig, CpuAttention, CpuLinear, DType, QFormat, QuantConfig
from trtbuild.convert.convert import convert
from trtbuild.quantize.quantize import quantize
from trtbuild.runtime.batch import StepBatch

BLOCK = 16
NO_SPIN = {"session.intra_op.allow_spinning": "0"}  # two sessions in one process: idle workers must not spin


def make_models(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    """Save the two random models (Hugging Face folders) under ``root``; name -> folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    specs = {
        "moe": ("mixtral", dict(num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                                intermediate_size=args.expert_width, sliding_window=None)),
        "dense": ("llama", dict(intermediate_size=args.top_k * args.expert_width)),
    }  # fmt: skip
    out = {}
    for name, (model_type, extra) in specs.items():
        out[name] = root / f"{name}-hf"
        if (out[name] / "config.json").is_file():  # --keep: made by an earlier run
            continue
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **common, **extra))
        model.save_pretrained(str(out[name]))
        params = sum(p.numel() for p in model.parameters())
        print(f"{name}: {model_type}, {params / 1e6:.1f} M parameters", flush=True)
    return out


def build_engines(args: argparse.Namespace, sources: dict[str, Path], root: Path) -> dict[str, Path]:
    builds = {"": BuildConfig(max_seq_len=1024)}
    if args.lowered:
        builds[" lowered"] = BuildConfig(
            max_seq_len=1024, cpu_attention=CpuAttention.LOWERED, cpu_linear=CpuLinear.ONNXRUNTIME
        )
    engines = {}
    for name, hf in sources.items():
        float_ckpt = root / f"{name}-ckpt"
        if not float_ckpt.is_dir():
            convert(hf, float_ckpt, DType.FLOAT32)
        for qformat in quantized_formats(args) or [None]:
            ckpt = float_ckpt
            if qformat is not None:
                group = f"-g{args.group_size}" if qformat is QFormat.INT4_WO else ""
                ckpt = root / f"{name}-{qformat.value}{group}-ckpt"
                if not ckpt.is_dir():
                    quantize(float_ckpt, ckpt, QuantConfig(qformat, group_size=args.group_size), progress=False)
            for suffix, build in builds.items():
                label = ("" if qformat is None else f" {qformat.value}") + suffix
                engines[name + label] = root / f"{ckpt.name.removesuffix('-ckpt')}{suffix.replace(' ', '-')}-engine"
                if not engines[name + label].is_dir():
                    build_engine(ckpt, engines[name + label], build)
    return engines


def quantized_formats(args: argparse.Namespace) -> list[QFormat]:
    """The weight-only formats asked for (``--int8``, ``--int4``); none: float32."""
    return [f for f, asked in ((QFormat.INT8_WO, args.int8), (QFormat.INT4_WO, args.int4)) if asked]


class Decoder:
    """One sequence on one engine: prefilled with ``context`` tokens, then decoded a step at a time."""

    def __init__(self, engine: Path, context: int, steps: int, rounds: int) -> None:
        self.session = OrtSession(engine, kv_cache_memory=256 << 20, session_config=NO_SPIN)
        total = context + steps * (rounds + 1)
        self.table = list(range(1, -(-total // BLOCK) + 1))
        rng = np.random.default_rng(0)
        self.vocab = self.session.config.model.vocab_size
        prompt = [int(t) for t in rng.integers(0, self.vocab, context)]
        self.session.step(StepBatch.build([prompt], [0], [self.table]))
        self.position = context

    def step(self) -> float:
        batch = StepBatch.build([[self.position % self.vocab]], [self.position], [self.table])
        start = time.perf_counter()
        self.session.step(batch)
        self.position += 1
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000, help="Mixtral's; a small one leaves the MLPs most of a step")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--lowered", action="store_true", help="also time both models built with standard ops only")
    p.add_argument("--int8", action="store_true", help="time int8_wo checkpoints of both models")
    p.add_argument("--int4", action="store_true", help="time int4_wo checkpoints of both models")
    p.add_argument("--group-size", type=int, default=128, help="int4_wo's in-features per scale")
    p.add_argument("--keep", type=Path, help="make the models and engines here (reused when present)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        engines = build_engines(args, make_models(args, root), root)
        decoders = {name: Decoder(e, args.context, args.steps, args.rounds) for name, e in engines.items()}
        for d in decoders.values():  # warm-up
            d.step()
        rounds: dict[str, list[float]] = {name: [] for name in decoders}
        for _ in range(args.rounds):
            for name, d in decoders.items():
                rounds[name].append(statistics.median(d.step() for _ in range(args.steps)))
    median = {name: statistics.median(times) for name, times in rounds.items()}
    kinds = [f.value for f in quantized_formats(args)] or ["float32"]
    print(
        f"{', '.join(kinds)} batch-1 decode step at context {args.context}, "
        f"median of {args.rounds} rounds x {args.steps} steps:"
    )
    for name, t in median.items():
        print(f"  {name:22s} {t * 1e3:8.2f} ms  (fastest round {min(rounds[name]) * 1e3:.2f} ms)")
    for suffix in sorted({name.removeprefix("moe") for name in median if name.startswith("moe")}):
        if "dense" + suffix in median:
            ratio = median["moe" + suffix] / median["dense" + suffix]
            per_round = [m / d for m, d in zip(rounds["moe" + suffix], rounds["dense" + suffix], strict=True)]
            spread = f"per round: median {statistics.median(per_round):.2f}, {min(per_round):.2f}-{max(per_round):.2f}"
            print(f"ratio moe{suffix} / dense{suffix}: {ratio:.2f} ({spread})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
