"""A sampler that makes the model say chosen text: for end-to-end tests of what reads the reply."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from aioexperts import Tokenizer

__all__ = ("ScriptedSampler",)


class ScriptedSampler:
    """A sampler (the ``(logits, history) -> token id`` callable of :meth:`aioexperts.Model.stream`
    and of ``ServerOptions.sampler_factory``) that returns ``ids`` in order, then ``end`` each time.

    The logits are ignored: the model's weights do not matter, the reply is the script. With the
    built-in model's byte-level vocabulary any text can be scripted (:meth:`from_text`).

    Args:
        ids: the token ids to return, in order.
        end: the id returned once ``ids`` are used up (an end-of-generation id ends the reply).

    Example::

        import asyncio
        import aioexperts
        from aioexperts.testing import ScriptedSampler, builtin_model_path

        async def main() -> None:
            async with aioexperts.load(builtin_model_path(), slots=256, n_ctx=512) as model:
                sampler = ScriptedSampler.from_text(model.tokenizer, '{"name": "f", "arguments": {}}')
                pieces = [piece async for piece in model.stream("Hi", sampler=sampler, max_tokens=64)]
                print("".join(pieces))  # the scripted text

        asyncio.run(main())
    """

    def __init__(self, ids: Sequence[int], end: int) -> None:
        self.ids = list(ids)
        self.end = end
        self._next = 0

    @classmethod
    def from_text(cls, tokenizer: Tokenizer, text: str) -> ScriptedSampler:
        """A script of ``text`` (tokenized with special tokens parsed) ending with the vocabulary's EOS.

        Raises:
            ConfigError: the vocabulary has no EOS id.
            TokenizerError: from the tokenizer.
        """
        from aioexperts import ConfigError

        if tokenizer.eos_id is None:
            raise ConfigError("ScriptedSampler.from_text needs a vocabulary with an EOS id")
        return cls(tokenizer.encode(text, add_special=False, parse_special=True), tokenizer.eos_id)

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> int:
        if self._next < len(self.ids):
            self._next += 1
            return self.ids[self._next - 1]
        return self.end
