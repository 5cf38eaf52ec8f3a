"""Helpers shared across the suite (factories, model fixtures' builders)."""
