"""Read backends: one interface (``base``), io_uring, a thread pool, and a scriptable fake for tests."""
