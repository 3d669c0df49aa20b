"""The built-in full model in the user cache (:mod:`aioexperts.testing._builtin`, re-exported for the bench)."""

from __future__ import annotations

from ..testing._builtin import ensure_full_model, full_model_path
from ..testing._cache import print_progress
from ..testing._full_model import DEFAULT_FULL_LAYERS

__all__ = ("DEFAULT_FULL_LAYERS", "ensure_full_model", "full_model_path", "print_progress")
