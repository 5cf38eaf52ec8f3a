"""Boundary spans of every request: the DuckDB trace store, OTLP export, `lumen trace`."""
