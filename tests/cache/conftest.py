"""Fixtures of the cache tests: the fault tests' small synthetic model and its bytes (one per session)."""

from faults.conftest import model_path, reference

__all__ = ("model_path", "reference")
