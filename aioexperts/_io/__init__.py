"""io layer of aioexperts (private)."""
