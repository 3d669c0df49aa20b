"""Text in, text out: the tokenizer built from a GGUF's ``tokenizer.ggml.*`` keys (``tokenizer.py``), chat
templates (``chat.py``), sampling."""

__all__: tuple[str, ...] = ()
