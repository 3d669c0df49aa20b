"""Text: tokenizer, chat templates, sampling."""
