"""predict layer of aioexperts (private)."""
