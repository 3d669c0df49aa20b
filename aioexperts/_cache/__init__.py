"""cache layer of aioexperts (private)."""
