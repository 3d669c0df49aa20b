"""aioexperts: stream the routed experts of MoE GGUF models from SSD."""
