"""Helpers for testing code that uses aioexperts: a scriptable fake read backend."""

from ._io.backends.fake import FakeBackend as FakeBackend

__all__ = ("FakeBackend",)
