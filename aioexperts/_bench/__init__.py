"""cli layer of aioexperts (private)."""
