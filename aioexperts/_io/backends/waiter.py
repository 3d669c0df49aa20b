"""Batched wake-ups of the event loop for an io_uring backend: one wake-up per batch of completions.

A wake-up of the event loop per completion costs more CPU than the read (the interpreter runs
cold after each sleep; measured in docs/architecture.md). Instead of the kernel writing the
eventfd the loop watches at every CQE, a waiter thread (``aioexperts-uring-waiter``) blocks in
``io_uring_enter(GETEVENTS)`` with a timeout (``IORING_FEAT_EXT_ARG``, Linux 5.11; GIL released)
until as many CQEs are in the CQ as the scheduler's wake hint allows (:meth:`IOBackend.set_wake_hint`:
the fewest completions after which a waiting request can go on), then writes that eventfd. The loop
arms the thread again after each reap and submit (:meth:`BatchedWakeupBackend._arm`).

Rules (the raw ring's and the ``liburing`` backend's alike):

- a hint too high only delays a wake-up: the waiter looks again every :data:`WAITER_TIMEOUT`
  seconds and wakes the loop once any CQE is ready;
- each attach starts a waiter with an arming eventfd of its own (a waiter stopped by a detach
  cannot take the next one's arming), on its own duplicates of the ring's and the eventfds'
  descriptors, so it never waits on, reads or writes a number the backend closed;
- a waiter that dies wakes the loop once more, and the loop hands the wake-ups back to the kernel
  (:meth:`BatchedWakeupBackend._wake_per_completion`: the eventfd is written per CQE again).

The thread touches no ring memory and no backend state but ``_want`` (read) and
``_waiter_failed`` (written once).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from abc import abstractmethod

from .. import uring_raw
from .base import IOBackend

__all__ = ("WAITER_TIMEOUT", "BatchedWakeupBackend")

log = logging.getLogger("aioexperts")

#: How long the completion waiter blocks in one ``io_uring_enter`` before it looks again (seconds): the
#: bound on a wake-up delayed by a count of completions that was too high, and on its stop after detach.
WAITER_TIMEOUT = 0.02


class BatchedWakeupBackend(IOBackend):
    """An :class:`IOBackend` over an io_uring whose completions wake the loop through the eventfd
    ``_efd``, once per batch while :attr:`_batching` (module docstring).

    A subclass sets ``_efd`` and ``_batching`` in its constructor (batching only where the kernel
    waits with a timeout; else it has the kernel write the eventfd per CQE), calls
    :meth:`_start_waiter` in ``attach`` after watching the eventfd, :meth:`_stop_waiter` in
    ``detach``, :meth:`_join_waiter` in ``close`` before releasing the ring, :meth:`_reaping` first
    in each reap and :meth:`_arm` after each reap and submit; and implements :meth:`_waiter_ring_fd`,
    :meth:`_reads_in_kernel` and :meth:`_wake_per_completion`.

    Attributes:
        wakeups: reaps started by a wake-up (statistics).
    """

    def _init_wakeups(self) -> None:
        self._efd = -1
        self._go = -1  # the running waiter thread's eventfd (one per attach): the loop arms it through it
        self._batching = False
        self._armed = False  # the waiter thread waits for ``_want`` completions and will wake the loop
        self._want = 1
        self._waiter: threading.Thread | None = None
        self._waiter_stop: list[bool] = [False]  # the running waiter's own stop flag
        self._waiter_failed = False  # the waiter thread died: the kernel writes the eventfd again
        self.wakeups = 0

    @abstractmethod
    def _waiter_ring_fd(self) -> int:
        """The ring's descriptor (the waiter thread waits on a duplicate of it)."""

    @abstractmethod
    def _reads_in_kernel(self) -> int:
        """Entries the kernel has consumed whose CQE has not been reaped (reads, and NOPs where the
        backend leaves some): the most completions an arming may wait for. An over-count only delays
        a wake-up (by :data:`WAITER_TIMEOUT` at most once any CQE is ready); 0 or less arms nothing."""

    @abstractmethod
    def _wake_per_completion(self) -> None:
        """Have the kernel write ``_efd`` at every CQE again (the waiter died; loop thread). Must
        not raise: on failure, log and make sure the CQEs already there are reaped."""

    # -- the waiter thread's life (loop thread) ------------------------------------------------------

    def _start_waiter(self) -> None:
        """Start a waiter thread for this attach, and arm it (loop thread; only while batching)."""
        stop = self._waiter_stop = [False]
        # an arming eventfd of its own (a waiter stopped by an earlier detach may still read the one
        # it had), and its own duplicates of the descriptors: whenever it ends, it never waits on,
        # reads or writes a descriptor number the backend closed (and the system gave to another file)
        self._go = os.eventfd(0, os.EFD_CLOEXEC)
        fds = (os.dup(self._waiter_ring_fd()), os.dup(self._go), os.dup(self._efd))
        self._waiter = threading.Thread(
            target=self._wait_loop, args=(stop, *fds), name="aioexperts-uring-waiter", daemon=True
        )
        self._waiter.start()
        self._arm()

    def _stop_waiter(self) -> None:
        """Tell the running waiter thread to end, and let go of its arming eventfd (it has its own)."""
        self._armed = False
        self._waiter_stop[0] = True
        if self._go >= 0:
            go, self._go = self._go, -1
            try:
                os.eventfd_write(go, 1)
            finally:
                os.close(go)

    def _join_waiter(self) -> None:
        """Stop the waiter thread; off the loop thread, also wait for it to end (within
        :data:`WAITER_TIMEOUT`). On the loop thread (which must not block) it ends by itself: it
        uses only its own descriptors, and its duplicate of the ring's keeps the ring until then."""
        waiter, self._waiter = self._waiter, None
        if waiter is None:
            return
        self._stop_waiter()
        if not self.loop.is_current() and waiter is not threading.current_thread():
            waiter.join()

    # -- batched wake-ups (loop thread; the waiter thread only waits and writes the eventfd) ---------

    def _arm(self) -> None:
        """Have the waiter thread wake the loop after the hinted number of completions (loop thread).

        Only while batching and attached, not armed already, with reads the kernel has taken: the
        count is the wake hint, at least 1 and at most the reads in the kernel (counted from the CQ
        head, so completions already in the CQ count). A request that starts waiting while the
        thread is armed is served by that arming: at worst once the requests that waited before it
        can go on (or after :data:`WAITER_TIMEOUT`); its own need counts from the next wake-up."""
        if self._armed or not self._attached or not self._batching:
            return
        in_kernel = self._reads_in_kernel()
        if in_kernel <= 0:
            return
        hint = self._wake_hint
        want = 1
        if hint is not None:
            try:
                want = hint()
            except Exception:  # a wake-up per completion is always correct
                log.exception("the wake hint failed; waking per completion")
                want = 1
        self._want = max(1, min(want, in_kernel))
        self._armed = True
        os.eventfd_write(self._go, 1)

    def _reaping(self) -> None:
        """First thing of a reap (loop thread): the arming is used up; a dead waiter hands the
        wake-ups back to the kernel."""
        self._armed = False
        self.wakeups += 1
        if self._waiter_failed and self._batching:
            self._batching = False
            self._wake_per_completion()

    def _wait_loop(self, stop: list[bool], ring_fd: int, go: int, efd: int) -> None:
        """The waiter thread, on its own duplicates of the ring's, the arming's and the loop's
        descriptors (closed as it ends): for each arming, block until ``_want`` CQEs are ready (or
        some are at a :data:`WAITER_TIMEOUT`), then write the eventfd the loop watches. Touches no
        ring memory. Ends once ``stop[0]`` is set (detach), within :data:`WAITER_TIMEOUT`."""
        try:
            while True:
                os.eventfd_read(go)  # blocks (GIL released) until armed or stopped
                if stop[0]:
                    return
                want = self._want
                while True:
                    ret = uring_raw.wait_cqes(ring_fd, want, WAITER_TIMEOUT)  # >= 0 at the timeout once some are ready
                    if stop[0]:
                        return
                    if ret >= 0:
                        break
                    if ret not in (-errno.ETIME, -errno.EINTR):
                        log.error("io_uring: waiting for completions failed (%s); waking the loop", os.strerror(-ret))
                        time.sleep(WAITER_TIMEOUT)
                        break
                os.eventfd_write(efd, 1)
        except Exception:  # not expected: the loop goes back to the kernel's eventfd (at its next reap)
            log.exception("io_uring: the completion waiter failed; waking the loop per completion from now on")
            self._waiter_failed = True
            try:
                os.eventfd_write(efd, 1)
            except OSError:
                pass
        finally:
            for fd in (ring_fd, go, efd):
                os.close(fd)
