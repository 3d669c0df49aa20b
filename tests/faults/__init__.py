"""Fault injection for the I/O core: checked and scripted backends, a liburing proxy, a test stack.

``tests/`` is on ``sys.path`` (its conftest.py), so any test imports these as ``faults.<module>``:

- :mod:`faults.guard`: :class:`~faults.guard.SlotGuard`, a mixin that records every read a backend
  takes and fails on a read into a slot another load still owns; :class:`~faults.guard.CheckedFake`
  and :class:`~faults.guard.CheckedUring` are the fake and the real io_uring backend with it.
- :mod:`faults.script`: :class:`~faults.script.ReadFault` (a completion fault on the read at the
  first / middle / last position of a batch) and :class:`~faults.script.FaultyFake`, a checked fake
  that also fails a chosen submit after taking a chosen number of reads.
- :mod:`faults.ringproxy`: :class:`~faults.ringproxy.RingFaults`, a stand-in for the ``liburing``
  module the real :class:`UringBackend` calls, raising on the n-th prep / submit / get_sqe, refusing
  buffer registration or the probe, and rewriting completions; it also checks, each time entries go
  to the kernel, that no read entry belongs to a read the scheduler no longer counts as in flight.
- :mod:`faults.stack`: builds files, slab, backend, scheduler and cache like the store does,
  drives them through the cache API and checks the core's invariants.
"""
