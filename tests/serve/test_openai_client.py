"""The official ``openai`` client against a real server: chat and text completions, streaming and
not, ``include_usage``, ``stop``, ``seed``, ``logprobs``, the same greedy text as ``aioexperts-run``,
and the other endpoints (``/v1/models``, ``/health``, ``/props``, ``/tokenize``, ``/detokenize``,
``/apply-template``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from serve.serving import API_KEY, RAISING_TEMPLATE, ServerThread, post, request

USER = [{"role": "user", "content": "Tell me a story about a cat."}]
PROMPT = "Once upon a time"


def test_chat_whole_and_streamed_agree_and_the_usage_is_counted(client: Any, served: ServerThread) -> None:
    whole = client.chat.completions.create(model="any", messages=USER, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    prompt = post(served, "/apply-template", {"messages": USER})[1]["prompt"]
    status, ids = post(served, "/tokenize", {"content": prompt})
    assert status == 200 and whole.usage.prompt_tokens == len(ids["tokens"])
    assert 1 <= whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model="any",
            messages=USER,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    *body, last = chunks
    assert last.choices == [] and last.usage is not None  # include_usage: a last chunk with only the usage
    assert all(c.usage is None for c in body)
    assert body[-1].choices[0].finish_reason == choice.finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in body) == choice.message.content
    details = "prompt_tokens_details"
    assert last.usage.model_dump(exclude={details}) == whole.usage.model_dump(exclude={details})
    # the same prompt again: the prompt cache held it (all but the last token, run again for its logits)
    assert 0 < last.usage.prompt_tokens_details.cached_tokens <= whole.usage.prompt_tokens - 1


def test_text_completion_whole_and_streamed_agree(client: Any) -> None:
    whole = client.completions.create(model="any", prompt=PROMPT, max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 10
    chunks = list(client.completions.create(model="any", prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_greedy_text_is_that_of_aioexperts_run(client: Any, serve_model: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "aioexperts.cli.run", str(serve_model), "-p", PROMPT, "-n", "16", "--temp", "0"]
        + ["--io", "threads", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    expected = json.loads(run.stdout)
    served = client.completions.create(model="any", prompt=PROMPT, max_tokens=16, temperature=0)
    assert expected["text"] and served.choices[0].text == expected["text"]
    assert served.usage.completion_tokens == expected["generated_tokens"]
    assert served.usage.prompt_tokens == expected["prompt_tokens"]


def test_a_stop_string_ends_the_text_before_it(client: Any) -> None:
    free = client.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    cut = len(free) // 2
    stop = free[cut : cut + 3]
    assert len(stop) == 3 and stop.strip(), free
    stopped = client.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].text == free[: free.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="any", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == free[: free.index(stop)]


def test_the_same_seed_gives_the_same_text(client: Any) -> None:
    def sample(seed: int) -> str:
        kw = {"temperature": 1.5, "top_p": 1.0, "seed": seed, "max_tokens": 12}
        return client.chat.completions.create(model="any", messages=USER, **kw).choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))  # the seed matters


def test_chat_logprobs_describe_each_token(client: Any) -> None:
    out = client.chat.completions.create(
        model="any", messages=USER, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    text = b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", "replace")
    assert text == out.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].bytes == entry.bytes  # greedy: the chosen token is the most likely one
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    plain = client.chat.completions.create(model="any", messages=USER, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content


def test_completion_logprobs_are_the_legacy_layout(client: Any) -> None:
    out = client.completions.create(model="any", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(chosen, rel=1e-6)  # greedy: the best one


def test_models_health_and_props(client: Any, served: ServerThread, serve_model: Path) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [serve_model.name]
    status, _, health = request(served, "GET", "/health", key=None)  # open without the key
    assert status == 200 and json.loads(health) == {"status": "ok"}
    status, props = 200, json.loads(request(served, "GET", "/props")[2])
    assert props["n_ctx"] == 512 and props["chat_template"] == RAISING_TEMPLATE
    assert props["slab"]["slots"] == 8 and props["slab"]["bytes"] == 8 * props["slab"]["slot_bytes"] > 0
    assert props["total_slots"] == 2 and props["eos_token"] == "<|im_end|>"


def test_tokenize_detokenize_and_apply_template(served: ServerThread) -> None:
    status, out = post(served, "/tokenize", {"content": "Hello <|im_start|>world"})
    assert status == 200 and out["tokens"]
    status, back = post(served, "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back["content"] == "Hello <|im_start|>world"
    status, plain = post(served, "/tokenize", {"content": "Hello <|im_start|>world", "parse_special": False})
    assert len(plain["tokens"]) > len(out["tokens"])  # the control token's text split as plain text
    status, pieces = post(served, "/tokenize", {"content": "Hello", "with_pieces": True})
    assert "".join(p["piece"] for p in pieces["tokens"]) == "Hello"
    status, empty = post(served, "/tokenize", {"content": ""})  # as llama.cpp's server: no tokens
    assert status == 200 and empty["tokens"] == []
    status, back = post(served, "/detokenize", {"tokens": empty["tokens"]})  # and back
    assert status == 200 and back["content"] == ""
    status, tmpl = post(served, "/apply-template", {"messages": USER})
    assert status == 200
    assert tmpl["prompt"] == f"<|im_start|>user\n{USER[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert API_KEY  # every call above sent it


def test_the_clients_usual_fields_are_accepted(client: Any) -> None:
    """The fields the client sends for ordinary requests: implemented, or hints accepted and ignored."""
    common = {"model": "any", "temperature": 0, "top_p": 1, "seed": 3, "n": 1, "user": "u-1", "stop": ["\n\n\n"]}
    common |= {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}}
    chat = client.chat.completions.create(
        messages=USER,
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "text"},
        tool_choice="none",
        parallel_tool_calls=False,
        store=False,
        metadata={"k": "v"},
        service_tier="auto",
        safety_identifier="s",
        prompt_cache_key="p",
        modalities=["text"],
        stream=True,
        stream_options={"include_usage": True},
        **common,
    )
    chunks = list(chat)
    assert chunks[-1].usage is not None and 1 <= chunks[-1].usage.completion_tokens <= 4
    text = client.completions.create(
        prompt=PROMPT, max_tokens=4, logprobs=1, echo=False, best_of=1, stream=False, **common
    )
    assert 1 <= text.usage.completion_tokens <= 4
