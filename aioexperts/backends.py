"""Extension point: custom read backends.

A backend reads expert bytes into slab slots and reports each completion on the event-loop
thread. Pass a factory to the store: ``aioexperts.open(path, io=IOOptions(backend=factory))``,
where ``factory(files, slab, loop, depth) -> IOBackend`` receives the open shard files
(:class:`ShardFiles`), the :class:`Slab`, the event-loop services (:class:`LoopAdapter`) and the
queue depth. The built-in backends (``"io_uring"``, ``"threads"``) implement the same interface;
:class:`aioexperts.testing.FakeBackend` is a scriptable one for tests.
"""

from ._io.backends.base import CompletionSink as CompletionSink
from ._io.backends.base import IOBackend as IOBackend
from ._io.backends.base import ReadOp as ReadOp
from ._io.files import ShardFiles as ShardFiles
from ._io.loop import AsyncEvent as AsyncEvent
from ._io.loop import LoopAdapter as LoopAdapter
from ._io.select import BackendFactory as BackendFactory
from ._io.slab import Slab as Slab
from ._io.uring_probe import io_uring_unusable_reason as io_uring_unusable_reason
from ._io.uring_probe import liburing_unusable_reason as liburing_unusable_reason

__all__ = (
    "AsyncEvent",
    "BackendFactory",
    "CompletionSink",
    "IOBackend",
    "LoopAdapter",
    "ReadOp",
    "ShardFiles",
    "Slab",
    "io_uring_unusable_reason",
    "liburing_unusable_reason",
)
