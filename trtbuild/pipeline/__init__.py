"""``trtbuild pipeline``: recipes -> a stage graph (plan.py) -> cached, parallel stage runs (runner.py, stages.py)
-> ``ARTIFACTS_DIR/<model>/<format>/<backend>/<target>/`` engine directories and ``index.json`` (index.py)."""
