"""A custom eviction policy (a subclass of the public ``aioexperts.policies.LRU``) whose hooks raise on demand."""

from __future__ import annotations

from collections.abc import Callable

from aioexperts.policies import LRU, Key

#: The hooks the cache calls on a policy.
HOOKS = ("victim", "remove", "access", "admit")


class OnceFaulty(LRU):
    """An LRU whose hook ``hook`` raises once when armed (``armed = True``, or :meth:`arm`).

    Attributes:
        hook: the hook that raises when armed (None: never).
        armed: the next call of ``hook`` raises ``RuntimeError`` (then it is disarmed).
        raised: how many times a hook raised.
    """

    def __init__(self, hook: str | None = None) -> None:
        super().__init__()
        self.hook = hook
        self.armed = False
        self.raised = 0

    def arm(self, hook: str) -> None:
        """The next call of ``hook`` raises."""
        self.hook = hook
        self.armed = True

    def _maybe_raise(self, name: str) -> None:
        if self.armed and name == self.hook:
            self.armed = False
            self.raised += 1
            raise RuntimeError(f"scripted {name} failure")

    def admit(self, key: Key) -> None:
        self._maybe_raise("admit")
        super().admit(key)

    def access(self, key: Key) -> None:
        self._maybe_raise("access")
        super().access(key)

    def remove(self, key: Key) -> None:
        self._maybe_raise("remove")
        super().remove(key)

    def victim(self, can_evict: Callable[[Key], bool]) -> Key | None:
        self._maybe_raise("victim")
        return super().victim(can_evict)
