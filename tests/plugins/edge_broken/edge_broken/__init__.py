"""Deliberately broken backends, one per module."""
