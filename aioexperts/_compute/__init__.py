"""compute layer of aioexperts (private)."""
