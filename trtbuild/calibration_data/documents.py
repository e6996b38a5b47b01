"""The documents of a dataset's split, or of a user's file, and their token ids.

A user source is a path instead of a dataset name (``datasets.py``): a ``.jsonl`` file (one JSON object per line
with a ``"text"`` string) or any other file read as UTF-8 text with documents separated by blank lines. A user
file is not split: both stages use all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..configio import json_lines
from ..errors import TrtbuildError
from .datasets import DATASETS, DatasetSpec, Split, Unit


def load_documents(source: str, split: Split, *, cache_dir: Path | None = None) -> list[str]:
    """The documents of ``source`` (a dataset name or a text/JSONL path) in ``split``; never empty."""
    spec = DATASETS.get(source)
    if spec is None:
        path = Path(source)
        if not path.exists():
            known = ", ".join(sorted(DATASETS))
            raise TrtbuildError(f"{source}: no such dataset file, and not a dataset name (known: {known})")
        docs = _read_user_file(path)
    else:
        from .fetch import dataset_files

        docs = _documents_of(spec, dataset_files(spec, cache_dir))
        docs = [
            d for i, d in enumerate(docs) if (i % spec.eval_every == spec.eval_every - 1) == (split is Split.EVALUATION)
        ]
    if not docs:
        raise TrtbuildError(f"{source}: no text in the {split.value} data (empty file?)")
    return docs


def _documents_of(spec: DatasetSpec, files: Sequence[Path]) -> list[str]:
    docs: list[str] = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if spec.unit is Unit.LINE:
            docs.extend(line.strip() for line in text.splitlines() if line.strip())
        elif text.strip():
            docs.append(text.strip())
    return list(dict.fromkeys(docs))  # the Lee corpus repeats a few articles: keep the splits disjoint


def _read_user_file(path: Path) -> list[str]:
    if path.is_dir():
        raise TrtbuildError(f"{path}: is a directory, expected a text or .jsonl file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TrtbuildError(f"{path}: not UTF-8 text") from None
    if path.suffix == ".jsonl":
        docs = []
        for where, obj in json_lines(text, str(path)):
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise TrtbuildError(f'{where}: expected an object with a "text" string')
            if obj["text"].strip():
                docs.append(obj["text"].strip())
        return docs
    return [p.strip() for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]


def token_windows(token_ids: Sequence[int], count: int, length: int) -> np.ndarray:
    """Up to ``count`` non-overlapping windows of ``length`` tokens from the start of the stream, ``[n, length]``.

    When the stream is shorter than one window, the single window is the whole stream.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    if len(ids) < 2:
        raise TrtbuildError(f"the text has {len(ids)} token(s); at least 2 are needed")
    n = min(count, len(ids) // length)
    if n == 0:
        return ids[None, :]
    return ids[: n * length].reshape(n, length)


def tokenize_documents(tokenizer_file: Path, docs: Sequence[str], needed: int) -> list[int]:
    """Token ids of ``docs`` (each followed by a blank line), stopping once ``needed`` tokens are collected."""
    from tokenizers import Tokenizer

    if not tokenizer_file.is_file():
        raise TrtbuildError(f"{tokenizer_file.parent}: no tokenizer.json, so text cannot be tokenized")
    tok = Tokenizer.from_file(str(tokenizer_file))
    ids: list[int] = []
    for doc in docs:
        ids.extend(tok.encode(doc + "\n\n", add_special_tokens=False).ids)
        if len(ids) >= needed:
            break
    return ids
