"""Doors (e): the reply parsers and the Anthropic request validation.

- :class:`aioexperts.ReplyParser` of every format on text built from the formats' markers, JSON bits
  and plain text: it never raises, the reply read in any two pieces is the reply read whole, and
  with nothing to read (no tools, no reasoning) the reply is its text.
- ``POST /v1/messages`` bodies (any JSON value, and Anthropic-shaped bodies with odd fields): a
  checked request or a 4xx ``APIError``, never another exception.
"""

from __future__ import annotations

import fuzzkit as kit
from hypothesis import given
from hypothesis import strategies as st

from aioexperts import TOOL_CALL_FORMATS, Reply, ReplyParser
from aioexperts.serve._anthropic import parse_messages_request
from aioexperts.serve._errors import APIError

PIECES = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<function=f>",
    "<parameter=a>",
    "</parameter>",
    "</function>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
    "function",
    "\n```json\n",
    "```",
    "<|channel|>",
    "analysis",
    "final",
    "commentary to=functions.f ",
    "<|constrain|>json",
    "<|message|>",
    "<|end|>",
    "<|start|>assistant",
    "<|channel|>analysis<|message|>",
    "<|start|>assistant<|channel|>final<|message|>",
    "<|channel|>commentary to=functions.f <|constrain|>json<|message|>",
    "<tool_call>\n",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>",
    '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "f", "parameters": {}}',
    '[{"name": "f", "arguments": {}}]',
    '{"a": [1, "x"]}',
    "{",
    "}",
    ";",
    " ",
    "\n",
    "<",
    "hello",
    "日本",
]
replies = st.lists(st.sampled_from(PIECES), max_size=14).map("".join)


#: Well-formed replies of each format, which the test mutates (pieces inserted, characters cut out).
SKELETONS = {
    "hermes": [
        '<think>\nhm\n</think>\n\nText.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n',
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    ],
    "llama3": ['<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "Plain."],
    "mistral": ['Hi.[TOOL_CALLS][{"name": "f", "arguments": {}, "id": "abcdefghi"}]', '[TOOL_CALLS]f[ARGS]{"a": 1}'],
    "deepseek": [
        "<think>x</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    ],
    "harmony": [
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Answer.",
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>',
    ],
}


@kit.FUZZ
@given(
    data=st.data(),
    fmt=st.sampled_from(TOOL_CALL_FORMATS),
    tools=st.booleans(),
    reasoning=st.booleans(),
    open_think=st.booleans(),
)
def test_fuzz_reply_parsers(data: st.DataObject, fmt: str, tools: bool, reasoning: bool, open_think: bool) -> None:
    text = data.draw(st.one_of(st.sampled_from(SKELETONS[fmt]), replies), label="base")
    edits = st.tuples(st.integers(0, 1 << 16), st.sampled_from(["", *PIECES]), st.integers(0, 3))
    for at, piece, cut_out in data.draw(st.lists(edits, max_size=3), label="edits"):
        at %= len(text) + 1
        text = text[:at] + piece + text[at + cut_out :]

    def make() -> ReplyParser:
        return ReplyParser(fmt, tools=tools, reasoning=reasoning, thinking_open=open_think, new_id=lambda: "id")

    whole = make().parse(text)
    for cut in range(len(text) + 1):
        p = make()
        split = Reply.join(p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish())
        assert split == whole, (text, cut)
    if not tools and not reasoning and fmt != "harmony":
        assert whole == Reply(text, "", ())  # nothing to read: the reply is its text


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=12,
)
anthropic_blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=10), st.integers())}),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": json_values, "name": st.text(max_size=6), "input": json_values}
    ),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": json_values, "content": json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "x"]), "thinking": json_values}),
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system"]),
            "content": st.one_of(st.text(max_size=8), st.lists(anthropic_blocks, max_size=3), json_values),
        }
    ),
    max_size=3,
)
bodies = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {"messages": messages, "max_tokens": st.one_of(st.integers(-1, 5), json_values)},
        optional={
            "system": st.one_of(st.text(max_size=6), json_values),
            "tools": st.one_of(json_values, st.lists(st.fixed_dictionaries({"name": st.text(max_size=6)}), max_size=2)),
            "tool_choice": st.one_of(json_values, st.fixed_dictionaries({"type": st.text(max_size=5)})),
            "thinking": json_values,
            "stop_sequences": json_values,
            "temperature": json_values,
            "top_k": json_values,
            "top_p": json_values,
            "stream": json_values,
            "chat_template_kwargs": json_values,
        },
    ),
)


@kit.FUZZ
@given(body=bodies)
def test_fuzz_anthropic_bodies(body: object) -> None:
    if not isinstance(body, dict):
        return  # parse_json refuses a non-object before this door
    try:
        parse_messages_request(body)
    except APIError as exc:
        status = exc.status
    else:
        return
    assert 400 <= status < 500, body
