"""The LM head's int8 quantization error alone, by grid: SmolLM2-135M in float32 (transformers) with only the head's
weight fake-quantized (symmetric int8, amax / 127 per output channel or per group of in-features), perplexity on
``trtbuild eval``'s windows of a dataset.

    .venv/bin/python benchmarks/lm_head_grid.py [--work artifacts/peers] [--dataset flask_docs]

Needs ``--work/hf-fp32`` and ``--work/trt-engine-fp32`` (``benchmarks/default_formats.py`` makes them). SmolLM2's
embedding (its tied head) was published as Q8_0, so int8 per group of 32 reproduces it exactly: read that row as a
property of this file, not of the grid.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

GRIDS = {"float32": 0, "per output channel": None, "group 192": 192, "group 64": 64, "group 32": 32}


def fake_int8(w: torch.Tensor, group: int | None) -> torch.Tensor:
    rows, cols = w.shape
    g = cols if group is None else group
    blocks = w.reshape(rows, cols // g, g)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.clamp(torch.round(blocks / scale), -127, 127) * scale).reshape(rows, cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("artifacts/peers"))
    parser.add_argument("--dataset", default="flask_docs")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from trtbuild.config import EvalConfig
    from trtbuild.eval import eval_windows

    windows = eval_windows(args.work / "trt-engine-fp32", EvalConfig(dataset=args.dataset))
    model = AutoModelForCausalLM.from_pretrained(str(args.work / "hf-fp32"), dtype=torch.float32).eval()
    head = model.lm_head.weight.detach()
    with torch.no_grad():
        hidden = [model.model(torch.from_numpy(np.asarray(w))[None]).last_hidden_state[0] for w in windows]
        for name, group in GRIDS.items():
            weight = head if group == 0 else fake_int8(head, group)
            nll, count = 0.0, 0
            for h, w in zip(hidden, windows, strict=True):
                targets = torch.from_numpy(np.asarray(w[1:]))
                nll += torch.nn.functional.cross_entropy((h @ weight.T)[:-1], targets, reduction="sum").item()
                count += len(targets)
            print(f"{name:20s} {np.exp(nll / count):.4f}", flush=True)


if __name__ == "__main__":
    main()
