"""Door (c): the chat template renderer on arbitrary message lists.

Roles of any kind, content that is text, None, a number, a list of parts or nested objects, extra
keys, huge and non-ASCII content, cycles; ``messages`` and ``tools`` that are not lists at all. The
templates are those of llama.cpp's vocabularies with chat goldens (qwen2, phi-3) and the built-in
model's ChatML one. ``render`` gives a ``str`` or raises ``ChatTemplateError``, nothing else.
"""

from __future__ import annotations

import random

import fuzzkit as kit
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from aioexperts import ChatTemplate

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(st.characters(codec=None, categories=None), max_size=30),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
)
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), json_values)
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": roles, "content": json_values}, optional={"name": json_values}),
        st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name", "x"]), json_values, max_size=4),
        json_values,
    ),
    max_size=6,
)


@pytest.fixture(scope="module")
def templates() -> dict[str, ChatTemplate]:
    return kit.load_templates()


def _run(templates: dict[str, ChatTemplate], msgs: object, tools: object, gen: bool) -> None:
    for template in templates.values():
        try:
            event(kit.chat_door(template, msgs, tools, gen))
        except kit.Unexpected as exc:
            raise exc.cause from exc


@kit.FUZZ
@given(msgs=st.one_of(messages, json_values), tools=st.one_of(st.none(), json_values), gen=st.booleans())
def test_fuzz_messages(templates: dict[str, ChatTemplate], msgs: object, tools: object, gen: bool) -> None:
    _run(templates, msgs, tools, gen)


@kit.FUZZ
@given(rnd=st.randoms(use_true_random=False))
def test_fuzz_generated_chats(templates: dict[str, ChatTemplate], rnd: random.Random) -> None:
    """Plausible chats with odd parts: many turns, a megabyte of content, content parts, cycles."""
    tools = None if rnd.random() < 0.8 else kit.random_json(rnd)
    _run(templates, kit.random_messages(rnd), tools, rnd.random() < 0.5)
