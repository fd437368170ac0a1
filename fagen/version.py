"""The package's version (pyproject.toml's), a leaf: every module may print it."""

__version__ = "0.1.0"
