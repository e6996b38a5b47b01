"""trtbuild plugin ops: each folder holds an op's contract (README), its reference implementation and its kernels.

Installed as the package ``trtbuild.plugins`` (see pyproject.toml's package-dir).
"""
