"""Helpers for testing code that uses aioexperts: a scriptable fake read backend."""

from ._fake_backend import FakeBackend as FakeBackend

__all__ = ("FakeBackend",)
