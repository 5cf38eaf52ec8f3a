"""Replay of recorded traffic through the real engine."""
