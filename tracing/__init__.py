"""Boundary spans, OTLP export and the DuckDB trace store (not built yet)."""
