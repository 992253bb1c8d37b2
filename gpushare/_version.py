"""The version of gpushare (the same as in pyproject.toml)."""

__version__ = "0.1.0.dev0"
