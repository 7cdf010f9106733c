"""The single source of the package version (read by pyproject.toml too)."""

__version__ = "2.8.3.1"
