"""The version of edge-core, in one place (the wheel metadata reads pyproject.toml)."""

__version__ = "0.1.0"
