"""The AOTInductor engine's files and the runner that loads them.

``engines/torch-<target>/`` holds:
- ``model.pt2``: an AOTInductor package of generated code only, with one or two programs (package model names):
  ``STEP_MODEL`` runs every step (token and sequence counts symbolic); ``DECODE_MODEL``, where built, runs the
  steps of one token and one logits row (a batch-1 decode step) with those sizes fixed at 1, so its one-row
  products are fused reductions (``importer.PortableModule.fuse_one_row``): ``torch.export`` cannot branch on a
  symbolic size, so one program serving every size would keep matmuls for them (on 2 CPU cores, 0.43x the
  onnxruntime engine's batch-1 decode; the fused products read the weights at DRAM speed instead of the BLAS's
  one-thread ~11 GB/s).
- ``weights.safetensors``: the constants of both programs, once (the exported module's buffers by name, in the
  layout the programs were compiled for). Loading reads it onto the device and hands every program the same tensors
  (``load_constants(user_managed=True)``): the weights are resident once, not once a program.

A package built with ``--max-autotune`` on the CPU (weights frozen into prepacked constants inside the code) has
its ``STEP_MODEL`` only and no weights file; so have packages of trtbuild before the decode program existed.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from ...errors import EngineError

STEP_MODEL = "model"  # AOTInductor's default model name: what aoti_load_package opens
DECODE_MODEL = "decode"
WEIGHTS_FILE = "weights.safetensors"


def package_models(package: Path) -> frozenset[str]:
    """The program names in ``package`` (``<archive>/data/aotinductor/<name>/...``)."""
    try:
        with zipfile.ZipFile(package) as archive:
            parts = [name.split("/") for name in archive.namelist()]
    except (OSError, zipfile.BadZipFile) as e:
        raise EngineError(f"{package}: not an AOTInductor package ({e})") from None
    return frozenset(p[3] for p in parts if len(p) > 4 and p[1:3] == ["data", "aotinductor"])


class AotiRunner:
    """Runs one step of an AOTInductor engine: ``runner(input_ids, positions, block_tables, query_start_loc,
    logits_indices, caches[, sliding_block_tables]) -> logits``, by ``DECODE_MODEL`` for a step of one token and
    one logits row where the package has it, else by ``STEP_MODEL``. The process must have imported ``ops.py``
    (the programs call the custom op). ``constants``: the weights every program points at (kept alive here)."""

    def __init__(self, package: Path, device: torch.device) -> None:
        from torch._inductor.package import load_package

        names = package_models(package)
        if STEP_MODEL not in names:
            raise EngineError(f"{package}: the AOTInductor package has no '{STEP_MODEL}' program")
        weights = package.parent / WEIGHTS_FILE
        try:
            # single-threaded: AOTInductor's default run waits on its previous run's CUDA event, which a stream
            # being captured into a CUDA graph (decode_graphs.py) may not do; the session runs one step at a time
            programs = {name: load_package(str(package), name, run_single_threaded=True) for name in sorted(names)}
            self.constants = load_file(str(weights), device=str(device)) if weights.is_file() else {}
        except Exception as e:
            raise EngineError(f"{package}: torch cannot load the package ({str(e).splitlines()[0]})") from None
        for name, program in programs.items() if self.constants else ():  # format 2: the weights are inside
            wanted = program.get_constant_fqns()
            missing = [f for f in wanted if f not in self.constants]
            if missing:
                raise EngineError(f"{weights} lacks {len(missing)} constant(s) of program '{name}', e.g. {missing[0]}")
            program.load_constants({f: self.constants[f] for f in wanted}, check_full_update=True, user_managed=True)
        self.step_program = programs[STEP_MODEL]
        self.decode_program = programs.get(DECODE_MODEL)

    def __call__(self, *args: object) -> torch.Tensor:
        input_ids, logits_indices = args[0], args[4]
        assert isinstance(input_ids, torch.Tensor) and isinstance(logits_indices, torch.Tensor)
        one = input_ids.shape[0] == 1 and logits_indices.shape[0] == 1
        program = self.decode_program if one and self.decode_program is not None else self.step_program
        return program(*args)
