"""Text in, text out: the tokenizer built from a GGUF's ``tokenizer.ggml.*`` keys (``tokenizer.py``)."""

__all__: tuple[str, ...] = ()
