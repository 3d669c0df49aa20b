"""format layer of aioexperts (private)."""
