"""Lumen's version, importable from every floor of the engine (engine/__init__ re-exports it)."""

__version__ = "0.1.0"
