"""The reply parsers: tool calls and reasoning of each format, on replies recorded from the formats'
own documentation, read whole and streamed split at every character boundary.

The templates in data/templates/ are llama.cpp's (``models/templates``, MIT), used to check that the
format is chosen from the template text.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

import aioexperts
from aioexperts import Reply, ReplyParser, ToolCall, tool_call_format

TEMPLATES = Path(__file__).parent / "data" / "templates"


def ids() -> itertools.count[int]:
    return itertools.count()


def parser(fmt: str, **kw: object) -> ReplyParser:
    counter = ids()
    return ReplyParser(fmt, new_id=lambda: f"id{next(counter)}", **kw)  # type: ignore[arg-type]


def call(name: str, args: dict[str, object], id: str = "id0") -> ToolCall:  # noqa: A002
    return ToolCall(name, json.dumps(args, ensure_ascii=False), id)


# (format, reply text, expected content, expected reasoning, expected calls); texts from each format's docs
CASES = [
    pytest.param(  # NousResearch Hermes-2-Pro-Llama-3-8B model card
        "hermes",
        '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>',
        "",
        "",
        [call("get_stock_fundamentals", {"symbol": "TSLA"})],
        id="hermes",
    ),
    pytest.param(  # Qwen docs, "Function Calling": two parallel calls after some text
        "hermes",
        'Let me check.\n\n<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
        '"San Francisco, CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": '
        '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>',
        "Let me check.",
        "",
        [
            call("get_current_temperature", {"location": "San Francisco, CA, USA"}),
            call("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}, "id1"),
        ],
        id="qwen-parallel",
    ),
    pytest.param(  # Qwen3 thinking mode: the <think> block, then a call
        "hermes",
        '<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>',
        "",
        "\nThe user wants the weather.\n",
        [call("get_weather", {"city": "Paris"})],
        id="qwen3-think",
    ),
    pytest.param(  # Qwen3-Coder's XML calls
        "hermes",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>",
        "",
        "",
        [call("get_weather", {"city": "Paris", "days": 3})],
        id="qwen3-coder",
    ),
    pytest.param(  # a call whose JSON is broken stays content, with its markers
        "hermes",
        'Sure <tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call> done',
        'Sure<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call> done',
        "",
        [],
        id="hermes-bad-json",
    ),
    pytest.param(  # Llama 3.1 prompt format docs: JSON based tool calling
        "llama3",
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
        "",
        "",
        [call("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
        id="llama3",
    ),
    pytest.param(  # Llama 3.1 docs: a built-in tool call is Python, not JSON: it stays content
        "llama3",
        '<|python_tag|>brave_search.call(query="current weather in Menlo Park, California")',
        '<|python_tag|>brave_search.call(query="current weather in Menlo Park, California")',
        "",
        [],
        id="llama3-builtin-stays-content",
    ),
    pytest.param(
        "llama3",
        "The capital of France is Paris.",
        "The capital of France is Paris.",
        "",
        [],
        id="llama3-text",
    ),
    pytest.param(  # Mistral docs, "Function calling" (v3 tokenizer: a JSON array with ids)
        "mistral",
        '[TOOL_CALLS][{"name": "retrieve_payment_status", "arguments": {"transaction_id": "T1001"}, '
        '"id": "D681PevKs"}]',
        "",
        "",
        [call("retrieve_payment_status", {"transaction_id": "T1001"}, "D681PevKs")],
        id="mistral-v3",
    ),
    pytest.param(  # Mistral Small 3.2 / Devstral (v11 tokenizer): name[ARGS]{...}
        "mistral",
        'Checking.[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}',
        "Checking.",
        "",
        [call("get_current_weather", {"location": "Paris, France", "format": "celsius"})],
        id="mistral-v11",
    ),
    pytest.param(  # DeepSeek-V3 model card (tokenizer_config.json chat template's call syntax)
        "deepseek",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"location": "Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "",
        "",
        [call("get_weather", {"location": "Tokyo"})],
        id="deepseek-v3",
    ),
    pytest.param(  # DeepSeek-R1: thinking opened by the template, then two calls
        "deepseek",
        "I need the weather.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'get_weather\n```json\n{"location": "Tokyo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
        '<｜tool▁sep｜>get_time\n```json\n{"tz": "JST"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "",
        "I need the weather.\n",
        [call("get_weather", {"location": "Tokyo"}), call("get_time", {"tz": "JST"}, "id1")],
        id="deepseek-r1-open-think",
    ),
    pytest.param(  # DeepSeek-V3.1 model card: name<｜tool▁sep｜>{json}
        "deepseek",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"location": "Tokyo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "",
        "",
        [call("get_weather", {"location": "Tokyo"})],
        id="deepseek-v3.1",
    ),
    pytest.param(  # OpenAI harmony response format docs: reasoning, then a function call
        "harmony",
        '<|channel|>analysis<|message|>User asks: "What is the weather in Tokyo?" We need to use '
        "get_current_weather tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_current_weather "
        '<|constrain|>json<|message|>{"location":"Tokyo"}<|call|>',
        "",
        'User asks: "What is the weather in Tokyo?" We need to use get_current_weather tool.',
        [call("get_current_weather", {"location": "Tokyo"})],
        id="harmony-call",
    ),
    pytest.param(  # harmony docs: reasoning and a final answer (<|return|> is an EOG token, not in the text)
        "harmony",
        "<|channel|>analysis<|message|>User asks: What is 2 + 2? Simple arithmetic.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.",
        "2 + 2 = 4.",
        "User asks: What is 2 + 2? Simple arithmetic.",
        [],
        id="harmony-final",
    ),
]


@pytest.mark.parametrize(("fmt", "text", "content", "reasoning", "calls"), CASES)
def test_a_recorded_reply_is_read_whole(fmt: str, text: str, content: str, reasoning: str, calls: list) -> None:
    open_think = fmt == "deepseek" and "</think>" in text and "<think>" not in text
    reply = parser(fmt, thinking_open=open_think).parse(text)
    assert reply == Reply(content, reasoning, tuple(calls))


@pytest.mark.parametrize(("fmt", "text", "content", "reasoning", "calls"), CASES)
def test_a_recorded_reply_split_anywhere_streams_the_same_reply(
    fmt: str, text: str, content: str, reasoning: str, calls: list
) -> None:
    open_think = fmt == "deepseek" and "</think>" in text and "<think>" not in text
    expected = Reply(content, reasoning, tuple(calls))
    for cut in range(len(text) + 1):
        p = parser(fmt, thinking_open=open_think)
        deltas = p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish()
        assert Reply.join(deltas) == expected, f"split at {cut}: {text[:cut]!r} | {text[cut:]!r}"
    # and one character per piece (every boundary at once): no marker text leaks out early
    p = parser(fmt, thinking_open=open_think)
    deltas = [d for ch in text for d in p.feed(ch)] + p.finish()
    assert Reply.join(deltas) == expected


def test_content_streams_before_the_reply_ends() -> None:
    p = parser("hermes")
    assert Reply.join(p.feed("Hello there, ")).content == "Hello there,"  # the space waits: a call may follow
    assert Reply.join(p.feed("friend<tool")).content == " friend"  # "<tool" may start "<tool_call>": held
    assert Reply.join(p.feed("box> ok") + p.finish()).content == "<toolbox> ok"


def test_without_tools_a_call_stays_content_and_reasoning_off_keeps_think() -> None:
    text = '<think>hm</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    raw_call = text[len("<think>hm</think>\n") :]
    assert parser("hermes", tools=False).parse(text) == Reply(raw_call, "hm", ())
    assert parser("hermes", tools=False, reasoning=False).parse(text) == Reply(text, "", ())


def test_an_unclosed_think_block_is_reasoning_and_a_later_think_is_content() -> None:
    assert parser("hermes").parse("<think>still thinking") == Reply("", "still thinking", ())
    assert parser("hermes").parse("Answer: <think>x</think>") == Reply("Answer: <think>x</think>", "", ())


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("Qwen-Qwen3-0.6B.jinja", "hermes"),
        ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
        ("Qwen3-Coder.jinja", "hermes"),
        ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes"),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"),
        ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"),
        ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
        ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral"),
        ("llama-cpp-deepseek-r1.jinja", "deepseek"),
        ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek"),
        ("openai-gpt-oss-120b.jinja", "harmony"),
    ],
)
def test_the_format_is_chosen_from_the_template(template: str, fmt: str) -> None:
    assert tool_call_format((TEMPLATES / template).read_text()) == fmt


def test_a_template_renders_tools_and_tool_calls_as_transformers_passes_them() -> None:
    tmpl = aioexperts.ChatTemplate((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    text = tmpl.render(messages, add_generation_prompt=True, tools=tools, extra={"enable_thinking": False})
    assert '"name": "get_weather"' in text and "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking reached the template
    assert tmpl.render(messages, add_generation_prompt=True, tools=tools).endswith("<|im_start|>assistant\n")


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(aioexperts.ConfigError, match="unknown tool-call format"):
        ReplyParser("xml")


@pytest.mark.parametrize(
    ("fmt", "name", "template", "rest"),
    [
        ("hermes", None, "", '{"name": "f", "arguments": {"a": 1}}\n</tool_call>'),
        ("hermes", "f", "", '{"a": 1}}\n</tool_call>'),
        ("llama3", None, "", 'f", "parameters": {"a": 1}}'),
        ("llama3", "f", "", '{"a": 1}}'),
        ("mistral", None, "", '[{"name": "f", "arguments": {"a": 1}}]'),
        ("mistral", "f", "", '{"a": 1}}]'),
        ("mistral", "f", "[TOOL_CALLS]{{ name }}[ARGS]", '{"a": 1}'),
        ("deepseek", None, "", 'f<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
        ("harmony", None, "", 'f <|constrain|>json<|message|>{"a": 1}'),
        ("harmony", "f", "", '{"a": 1}'),
    ],
)
def test_a_reply_continuing_a_call_prefix_is_that_call(fmt: str, name: str | None, template: str, rest: str) -> None:
    """``tool_choice`` required / named ends the prompt with :func:`call_prefix`; the model's reply continues it."""
    p = parser(fmt)
    assert p.feed(aioexperts.call_prefix(fmt, name, template)) == []  # nothing comes out of the prefix alone
    assert Reply.join(p.feed(rest) + p.finish()) == Reply("", "", (call("f", {"a": 1}),))
