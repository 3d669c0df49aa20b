"""Tool calls, reasoning and the Anthropic Messages API end to end: the official ``openai`` and
``anthropic`` clients against a real server whose built-in tiny model says a scripted reply
(:class:`aioexperts.testing.ScriptedSampler` through ``ServerOptions.sampler_factory``), with
Qwen3's chat template (llama.cpp's copy, tests/text/data/templates/)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import aioexperts
from aioexperts.serve import ServerOptions
from aioexperts.testing import ScriptedSampler
from serve.serving import API_KEY, ServerThread, post, request

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

QWEN3 = (Path(__file__).parents[1] / "text" / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_THEN_CALL = "<think>\nThe user wants the weather.\n</think>\n\n" + CALL


class Script:
    """The reply every generation of the server says next (set by the test)."""

    text = "Hello."
    tokenizer: aioexperts.Tokenizer | None = None

    def __call__(self, options: aioexperts.SamplingOptions) -> ScriptedSampler:
        assert self.tokenizer is not None
        return ScriptedSampler.from_text(self.tokenizer, self.text)


SCRIPT = Script()


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny full model with Qwen3's chat template."""
    from conftest import TINY_FULL_SPEC_FIELDS

    from aioexperts.testing import _full_model

    path = tmp_path_factory.mktemp("agent") / "tiny-qwen3.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_full_model, "CHATML_TEMPLATE", QWEN3)
        _full_model.write_full_model(path, _full_model.FullModelSpec(**TINY_FULL_SPEC_FIELDS))  # type: ignore[arg-type]
    SCRIPT.tokenizer = aioexperts.Tokenizer.from_gguf(path)
    return path


def start(path: Path, **options: Any) -> ServerThread:
    opts = ServerOptions(port=0, parallel=2, queue_size=4, api_key=API_KEY, sampler_factory=SCRIPT, **options)
    return ServerThread(path, opts, n_ctx=2048).start()  # room for the tools' schemas


@pytest.fixture(scope="module")
def agent_server(qwen3_model: Path) -> Iterator[ServerThread]:
    thread = start(qwen3_model)
    yield thread
    thread.stop()


@pytest.fixture
def oai(agent_server: ServerThread) -> Iterator[Any]:
    with openai.OpenAI(base_url=agent_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def claude(agent_server: ServerThread) -> Iterator[Any]:
    with anthropic.Anthropic(base_url=agent_server.url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def say(text: str) -> None:
    SCRIPT.text = text


# -- OpenAI ---------------------------------------------------------------------------------------


def test_a_tool_call_comes_back_whole_and_streamed(oai: Any) -> None:
    say(CALL)
    whole = oai.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""  # no marker text leaked as content


def test_reasoning_is_apart_from_the_content_whole_and_streamed(oai: Any) -> None:
    say("<think>\nPondering the question.\n</think>\n\nIt is sunny.")
    whole = oai.chat.completions.create(model="m", messages=USER)
    message = whole.choices[0].message
    assert message.content == "It is sunny." and whole.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == "\nPondering the question.\n"
    chunks = list(oai.chat.completions.create(model="m", messages=USER, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert (
        "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        == message.model_extra["reasoning_content"]
    )
    assert "".join(d.content or "" for d in deltas) == "It is sunny."


def test_reasoning_format_none_leaves_think_in_the_content(qwen3_model: Path) -> None:
    thread = start(qwen3_model, reasoning_format="none")
    try:
        say("<think>hm</think>Yes.")
        status, out = post(thread, "/v1/chat/completions", {"messages": USER})
        assert status == 200 and out["choices"][0]["message"]["content"] == "<think>hm</think>Yes."
        assert "reasoning_content" not in out["choices"][0]["message"]
    finally:
        thread.stop()
    with pytest.raises(aioexperts.ConfigError, match="reasoning_format must be one of none, auto, deepseek"):
        ServerOptions(reasoning_format="raw")


def test_reasoning_then_a_call(oai: Any) -> None:
    say(THINK_THEN_CALL)
    whole = oai.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    message = whole.choices[0].message
    assert message.tool_calls[0].function.name == "get_weather"
    assert message.model_extra["reasoning_content"] == "\nThe user wants the weather.\n"


def test_tool_choice_none_leaves_the_call_text_in_the_content(oai: Any) -> None:
    say(CALL)
    whole = oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="none")
    assert whole.choices[0].message.content == CALL and whole.choices[0].message.tool_calls is None
    assert whole.choices[0].finish_reason == "stop"


def test_a_named_tool_choice_starts_the_call_in_the_prompt(oai: Any, agent_server: ServerThread) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    status, out = post(agent_server, "/apply-template", {"messages": USER, "tools": TOOLS, "tool_choice": choice})
    assert status == 200 and out["prompt"].endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    say('{"city": "Oslo"}}\n</tool_call>')  # the model continues the call the prompt started
    whole = oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=choice)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}


NAMED = {"type": "function", "function": {"name": "get_weather"}}
#: (tool_choice, a reply that ignores it): no call, a closed call that does not parse (its text was
#: content at once, mid-stream), a call of another function than the named one and text after it.
IGNORING = [
    *[(choice, "I will not call anything.") for choice in ("required", NAMED)],
    *[(choice, "I will not call anything.</tool_call> Sunny, I guess.") for choice in ("required", NAMED)],
    (NAMED, '{"name": "get_time", "arguments": {}}\n</tool_call> It is noon.'),
]


@pytest.mark.parametrize(
    ("choice", "reply"), IGNORING, ids=[f"{'named' if c is NAMED else c}-{i}" for i, (c, _) in enumerate(IGNORING)]
)
def test_a_reply_that_ignores_tool_choice_is_a_422_and_never_content(
    oai: Any, agent_server: ServerThread, reply: str, choice: Any
) -> None:
    say(reply)
    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.UnprocessableEntityError) as err:  # 4xx: not retried by the client
        oai.chat.completions.create(model="m", messages=USER, tools=tools, tool_choice=choice)
    assert err.value.status_code == 422 and err.value.body["code"] == "tool_choice_not_followed"
    assert "the reply is not sent" in err.value.body["message"]

    body = {"messages": USER, "tools": tools, "tool_choice": choice, "stream": True}
    status, _, data = request(agent_server, "POST", "/v1/chat/completions", body)
    assert status == 200  # the headers went out before the reply was known
    lines = [line.removeprefix("data: ") for line in data.decode().split("\n\n") if line.strip()]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    chunks, last = events[:-1], events[-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}], deltas  # nothing of the reply was sent
    assert last["error"]["code"] == "tool_choice_not_followed"


def test_a_streamed_call_under_tool_choice_required_comes_whole_with_the_text_after_it(oai: Any) -> None:
    say('{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    chunks = list(
        oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required", stream=True)
    )
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Oslo"}]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_messages_and_calls_reach_the_template(agent_server: ServerThread) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    status, out = post(agent_server, "/apply-template", {"messages": messages, "tools": TOOLS})
    assert status == 200, out
    prompt = out["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert '"name": "get_weather", "description": "The weather in a city"' in prompt  # the tools' schemas


def test_an_assistants_reasoning_content_reaches_the_template(agent_server: ServerThread) -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."},
        {"role": "user", "content": "Thanks"},
    ]
    # Qwen3's template prints the reasoning of an assistant turn after the last user query only
    status, out = post(agent_server, "/apply-template", {"messages": messages[:2]})
    assert status == 200 and "<think>\nLook it up.\n</think>\n\nSunny." in out["prompt"], out
    status, out = post(agent_server, "/apply-template", {"messages": [{**messages[0], "reasoning_content": "x"}]})
    assert status == 400 and out["error"]["param"] == "messages[0].reasoning_content"


def test_a_template_without_tools_gets_them_in_a_system_message(tiny_full_model: Path) -> None:
    """The built-in ChatML template never reads ``tools``: a system message lists them (and the syntax)."""
    thread = start(tiny_full_model)
    try:
        status, out = post(thread, "/apply-template", {"messages": USER, "tools": TOOLS})
        assert status == 200, out
        prompt = out["prompt"]
        assert prompt.startswith("<|im_start|>system\nYou may call these functions")
        assert json.dumps(TOOLS[0]["function"]) in prompt and "<tool_call>" in prompt
        system = [{"role": "system", "content": "Be brief."}, *USER]
        status, out = post(thread, "/apply-template", {"messages": system, "tools": TOOLS})
        assert status == 200 and out["prompt"].startswith("<|im_start|>system\nBe brief.\n\nYou may call")
        say(CALL)  # and the reply is read in that syntax
        status, out = post(thread, "/v1/chat/completions", {"messages": USER, "tools": TOOLS})
        assert status == 200 and out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    finally:
        thread.stop()


def test_a_template_without_tool_calls_shows_earlier_calls_and_results_in_the_note_syntax(
    tiny_full_model: Path, agent_server: ServerThread
) -> None:
    """ChatML never reads ``tool_calls``: an assistant's call was an empty turn and the result a bare
    ``tool`` turn; they are written as ``<tool_call>`` / ``<tool_response>`` blocks now. Qwen3's
    template, which reads them, renders them itself (once)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *USER,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_1", "content": ""},
    ]
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    thread = start(tiny_full_model)
    try:
        for tools in (TOOLS, None):  # with the tools note, and a turn without tools
            body: dict[str, Any] = {"messages": messages} if tools is None else {"messages": messages, "tools": tools}
            status, out = post(thread, "/apply-template", body)
            assert status == 200, out
            prompt = out["prompt"]
            assert f"<|im_start|>assistant\nLet me look.\n{block}\n{block}<|im_end|>" in prompt, prompt
            assert "<|im_start|>tool\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in prompt
            assert "<|im_start|>tool\n<tool_response>\n\n</tool_response><|im_end|>" in prompt
        nan_call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": NaN}'}}
        body = {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [nan_call]}]}
        status, out = post(thread, "/apply-template", body)  # NaN is not JSON: the arguments stay text
        assert status == 200 and '{"name": "f", "arguments": "{\\"x\\": NaN}"}' in out["prompt"], out
        big = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1e400}'}}
        body = {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [big]}]}
        status, out = post(thread, "/apply-template", body)  # beyond float: text too (was a 500)
        assert status == 200 and '"arguments": "{\\"x\\": 1e400}"' in out["prompt"], out
        as_object = {**big, "function": {"name": "f", "arguments": {"x": 1.0}}}
        raw = json.dumps({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [as_object]}]})
        raw = raw.replace('{"x": 1.0}', '{"x": 1e400}')  # an object holding a number Python reads as inf
        status, _, data = request(thread, "POST", "/apply-template", raw=raw.encode())
        assert status == 400 and "beyond the float range" in json.loads(data)["error"]["message"], data
    finally:
        thread.stop()
    status, out = post(agent_server, "/apply-template", {"messages": messages, "tools": TOOLS})
    assert status == 200 and out["prompt"].count(block) == 2, out


def test_an_empty_reply_and_an_empty_tool_result_go_back_as_history(oai: Any) -> None:
    """A reply a stop string cut at its start is empty; an agent sends it back, and a tool's empty
    output (OpenAI accepts both). A user message still needs text."""
    say("Hello.")
    first = oai.chat.completions.create(model="m", messages=USER, stop=["Hel"], max_tokens=4)
    assert first.choices[0].message.content == "" and first.choices[0].finish_reason == "stop"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    history = [
        *USER,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And now?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": ""},
    ]
    again = oai.chat.completions.create(model="m", messages=history, max_tokens=4)
    assert again.choices[0].message.content == "Hello."
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="m", messages=[{"role": "user", "content": ""}], max_tokens=4)
    assert err.value.body["param"] == "messages[0].content"


def test_a_forced_call_cut_by_max_tokens_is_length_not_a_422(oai: Any, claude: Any) -> None:
    """The model continues the call the prompt started and runs out of tokens: the reply comes back as
    it is with ``finish_reason`` ``length`` (Anthropic: ``max_tokens``), not as "no tool call"."""
    say('{"name": "get_weather", "arguments": {"city": "a very long city name that does not fit"}}\n</tool_call>')
    for stream in (False, True):
        if stream:
            chunks = list(
                oai.chat.completions.create(
                    model="m", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=6, stream=True
                )
            )
            reason = chunks[-1].choices[0].finish_reason
        else:
            out = oai.chat.completions.create(
                model="m", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=6
            )
            reason = out.choices[0].finish_reason
            assert not out.choices[0].message.tool_calls
        assert reason == "length", stream
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    got = claude.messages.create(model="m", max_tokens=6, messages=USER, tools=tools, tool_choice={"type": "any"})
    assert got.stop_reason == "max_tokens"


def test_a_second_call_cut_by_max_tokens_is_length_not_tool_calls(oai: Any, claude: Any) -> None:
    """One call whole, the next cut by the token limit: ``length`` (Anthropic: ``max_tokens``), so an
    agent knows a call may be missing, never ``tool_calls`` / ``tool_use``."""
    assert SCRIPT.tokenizer is not None
    say(CALL + "\n" + CALL)
    limit = len(SCRIPT.tokenizer.encode(CALL + "\n<tool_call>\n", add_special=False)) + 2
    out = oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=limit)
    assert out.choices[0].finish_reason == "length"
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]
    chunks = list(oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=limit, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len([tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]) == 1
    got = claude.messages.create(model="m", max_tokens=limit, messages=USER, tools=A_TOOLS)
    assert got.stop_reason == "max_tokens" and [b.type for b in got.content if b.type == "tool_use"] == ["tool_use"]

    say(CALL + "\n" + CALL)  # both fit: tool_calls / tool_use as before
    out = oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=200)
    assert out.choices[0].finish_reason == "tool_calls" and len(out.choices[0].message.tool_calls) == 2
    assert claude.messages.create(model="m", max_tokens=200, messages=USER, tools=A_TOOLS).stop_reason == "tool_use"


def test_a_model_is_retrieved_by_its_id_and_another_id_is_404(oai: Any) -> None:
    listed = oai.models.list().data
    assert [m.id for m in listed] == [oai.models.retrieve(listed[0].id).id]
    with pytest.raises(openai.NotFoundError) as err:
        oai.models.retrieve("gpt-nonexistent")
    assert err.value.body["code"] == "model_not_found"


def test_chat_template_kwargs_reach_the_template(agent_server: ServerThread) -> None:
    off = {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    status, out = post(agent_server, "/apply-template", off)
    assert status == 200 and out["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    status, out = post(agent_server, "/apply-template", {"messages": USER})
    assert status == 200 and out["prompt"].endswith("<|im_start|>assistant\n")


# -- Anthropic ------------------------------------------------------------------------------------

A_TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
A_USER = [{"role": "user", "content": "Weather in Paris?"}]


def test_messages_text_reply_and_usage(claude: Any, agent_server: ServerThread) -> None:
    say("It is sunny.")
    msg = claude.messages.create(model="m", max_tokens=100, system="Be brief.", messages=A_USER)
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "end_turn"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "It is sunny."
    counted = claude.messages.count_tokens(model="m", system="Be brief.", messages=A_USER)
    assert msg.usage.input_tokens == counted.input_tokens > 0
    assert msg.usage.output_tokens == len(SCRIPT.tokenizer.encode("It is sunny.", add_special=False))  # type: ignore[union-attr]


def test_messages_tool_use_thinking_whole_and_streamed(claude: Any) -> None:
    say(THINK_THEN_CALL)
    msg = claude.messages.create(model="m", max_tokens=200, messages=A_USER, tools=A_TOOLS)
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking == "\nThe user wants the weather.\n"
    use = msg.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")

    with claude.messages.stream(model="m", max_tokens=200, messages=A_USER, tools=A_TOOLS) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(events)
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.content[0].thinking == msg.content[0].thinking


def test_messages_stream_has_ping_and_text_deltas(agent_server: ServerThread) -> None:
    say("Hi there.")
    body = {"model": "m", "max_tokens": 50, "messages": A_USER, "stream": True}
    status, headers, data = request(agent_server, "POST", "/v1/messages", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [block.split("\n", 1) for block in data.decode().strip().split("\n\n")]
    names = [e[0].removeprefix("event: ") for e in events]
    payloads = [json.loads(e[1].removeprefix("data: ")) for e in events]
    assert names == [p["type"] for p in payloads]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(p["delta"]["text"] for p in payloads if p["type"] == "content_block_delta")
    assert text == "Hi there." and payloads[-2]["delta"]["stop_reason"] == "end_turn"


def test_messages_tool_result_and_tool_use_reach_the_template(claude: Any) -> None:
    say("It is sunny in Paris.")
    conversation = [
        *A_USER,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    msg = claude.messages.create(model="m", max_tokens=100, messages=conversation, tools=A_TOOLS)
    assert msg.content[0].text == "It is sunny in Paris."
    counted = claude.messages.count_tokens(model="m", messages=conversation, tools=A_TOOLS)
    plain = claude.messages.count_tokens(model="m", messages=A_USER, tools=A_TOOLS)
    assert msg.usage.input_tokens == counted.input_tokens > plain.input_tokens


def test_messages_stop_sequences(claude: Any) -> None:
    say("one two STOP three")
    msg = claude.messages.create(model="m", max_tokens=100, messages=A_USER, stop_sequences=["STOP"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP"
    assert msg.content[0].text == "one two "


def test_an_empty_stop_sequence_is_400(claude: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="m", max_tokens=10, messages=A_USER, stop_sequences=["STOP", ""])
    assert "stop_sequences: a stop sequence must not be empty" in err.value.body["error"]["message"]


def test_messages_max_tokens(claude: Any) -> None:
    say("a long reply " * 20)
    msg = claude.messages.create(model="m", max_tokens=3, messages=A_USER)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_messages_tool_choice_any_ignored_is_a_422_and_no_text_is_streamed(
    claude: Any, agent_server: ServerThread
) -> None:
    say("I will not call anything.</tool_call> Sunny, I guess.")
    with pytest.raises(anthropic.UnprocessableEntityError) as err:
        claude.messages.create(model="m", max_tokens=100, messages=A_USER, tools=A_TOOLS, tool_choice={"type": "any"})
    assert "tool_choice asked for 'required'" in err.value.body["error"]["message"]
    body = {"model": "m", "max_tokens": 100, "messages": A_USER, "tools": A_TOOLS, "tool_choice": {"type": "any"}}
    status, _, data = request(agent_server, "POST", "/v1/messages", {**body, "stream": True})
    names = [block.split("\n", 1)[0].removeprefix("event: ") for block in data.decode().strip().split("\n\n")]
    assert status == 200 and names == ["message_start", "ping", "error"], names  # no text block was sent


def test_messages_errors_have_anthropics_shape(claude: Any, agent_server: ServerThread) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="m", max_tokens=0, messages=A_USER)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in err.value.body["error"]["message"]
    assert "must be an integer >= 1, got 0" in err.value.body["error"]["message"]  # given: not "required"
    status, _, data = request(agent_server, "POST", "/v1/messages", {"messages": A_USER})
    assert status == 400 and "is required" in json.loads(data)["error"]["message"]
    status, _, data = request(agent_server, "POST", "/v1/messages", {"max_tokens": 5, "messages": A_USER}, key=None)
    body = json.loads(data)
    assert status == 401 and body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": body["error"]["message"]},
    }
    prefill = [*A_USER, {"role": "assistant", "content": "It is"}]
    status, out = post(agent_server, "/v1/messages", {"max_tokens": 5, "messages": prefill})
    assert status == 400 and "prefill" in out["error"]["message"], out
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    status, out = post(
        agent_server, "/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [image]}]}
    )
    assert status == 400 and out["error"]["type"] == "invalid_request_error" and "image" in out["error"]["message"]
