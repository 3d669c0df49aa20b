"""The prompt cache across requests (aioexperts/serve/_prompt_cache.py) through a real server.

A conversation prefills only each turn's new tokens (the model's own counters of tokens run) and
answers as a server without the cache does; two clients with different histories each continue
their own; a small budget evicts the least recently used; a cancelled request leaves nothing
half-written in the pool.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aioexperts.serve import ServerOptions
from serve.serving import RawStream, ServerThread, metrics, post, request, wait_for

CHAT = "/v1/chat/completions"
BIG = 1 << 40  # a budget that never evicts here


def _server(path: Path, budget: int, parallel: int = 1) -> ServerThread:
    return ServerThread(path, ServerOptions(port=0, parallel=parallel, queue_size=8, prompt_cache_bytes=budget)).start()


@pytest.fixture(scope="module")
def fresh(serve_model: Path) -> Iterator[ServerThread]:
    """No prompt cache: every request prefills its whole prompt."""
    thread = _server(serve_model, 0)
    yield thread
    thread.stop()


@pytest.fixture
def cached(serve_model: Path) -> Iterator[ServerThread]:
    thread = _server(serve_model, BIG)
    yield thread
    thread.stop()


def _tokens_run(server: ServerThread) -> float:
    m = metrics(server)
    return m["aioexperts_tokens_prefilled_total"] + m["aioexperts_tokens_decoded_total"]


def _turn(server: ServerThread, messages: list[dict[str, str]], max_tokens: int = 8) -> dict[str, Any]:
    status, body = post(server, CHAT, {"messages": messages, "max_tokens": max_tokens, "temperature": 0}, key=None)
    assert status == 200, body
    return body


def _reply(body: dict[str, Any]) -> str:
    content = body["choices"][0]["message"]["content"]
    assert isinstance(content, str)
    return content


def _cached_tokens(body: dict[str, Any]) -> int:
    value = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(value, int)
    return value


def _check_prefill(server: ServerThread, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One turn; the tokens the model ran are the prompt's uncached ones plus the generated ones run."""
    before = _tokens_run(server)
    body = _turn(server, messages)
    usage = body["usage"]
    generated_run = usage["completion_tokens"] - (1 if body["choices"][0]["finish_reason"] == "length" else 0)
    assert _tokens_run(server) - before == usage["prompt_tokens"] - _cached_tokens(body) + generated_run
    return body


def test_a_three_turn_conversation_prefills_only_each_turns_new_tokens(
    cached: ServerThread, fresh: ServerThread
) -> None:
    messages: list[dict[str, str]] = []
    previous_prompt = 0
    for turn, text in enumerate(["Hello there", "Tell me more", "And then?"]):
        messages.append({"role": "user", "content": text})
        body = _check_prefill(cached, messages)
        if turn == 0:
            assert _cached_tokens(body) == 0
        else:  # the whole previous prompt (and what of the reply tokenizes the same) is reused
            assert _cached_tokens(body) >= previous_prompt
        previous_prompt = body["usage"]["prompt_tokens"]
        assert _reply(body) == _reply(_turn(fresh, messages)), f"turn {turn + 1} differs from a fresh server"
        messages.append({"role": "assistant", "content": _reply(body)})
    m = metrics(cached)
    assert m["aioexperts_prompt_cache_hits_total"] == 2
    assert m["aioexperts_prompt_tokens_cached_total"] > 0
    assert m["aioexperts_prompt_cache_entries"] == 1  # each turn's sequence replaced the last


def test_two_clients_with_different_histories_each_continue_their_own(
    cached: ServerThread, fresh: ServerThread
) -> None:
    a: list[dict[str, str]] = [{"role": "user", "content": "Alpha alpha alpha, tell me a story"}]
    b: list[dict[str, str]] = [{"role": "user", "content": "Bravo: what is a number?"}]
    firsts = {}
    for name, history in (("a", a), ("b", b)):
        body = _check_prefill(cached, history)
        firsts[name] = body["usage"]["prompt_tokens"]
        history += [{"role": "assistant", "content": _reply(body)}, {"role": "user", "content": f"more {name}"}]
    assert metrics(cached)["aioexperts_prompt_cache_entries"] == 2
    for name, history in (("a", a), ("b", b)):
        body = _check_prefill(cached, history)
        assert _cached_tokens(body) >= firsts[name], f"client {name} did not continue its own history"
        assert _reply(body) == _reply(_turn(fresh, history))


def _sequence_bytes(server: ServerThread) -> int:
    status, _, data = request(server, "GET", "/props", key=None)
    props = json.loads(data)
    assert status == 200 and props["prompt_cache"] is not None
    value = props["prompt_cache"]["sequence_bytes"]
    assert isinstance(value, int) and value > 0
    return value


def test_a_small_budget_evicts_the_least_recently_used(serve_model: Path) -> None:
    probe = _server(serve_model, BIG)
    try:
        per_sequence = _sequence_bytes(probe)
    finally:
        probe.stop()
    server = _server(serve_model, 2 * per_sequence)  # room for two sequences
    try:
        histories = [[{"role": "user", "content": f"Client {i} says {'x' * (i + 3)}"}] for i in range(3)]
        for history in histories:
            _turn(server, history)
        m = metrics(server)
        assert m["aioexperts_prompt_cache_entries"] == 2
        assert m["aioexperts_prompt_cache_bytes"] == 2 * per_sequence <= m["aioexperts_prompt_cache_capacity_bytes"]
        assert m["aioexperts_prompt_cache_evictions_total"] == 1
        assert m["aioexperts_sequences_live"] == 2  # the evicted sequence's KV cache is freed
        first_again = _turn(server, histories[0])  # client 0 was the least recently used: evicted
        newest_again = _turn(server, histories[2])
        assert _cached_tokens(newest_again) == newest_again["usage"]["prompt_tokens"] - 1
        assert _cached_tokens(first_again) == 0
    finally:
        server.stop()


def test_a_cancelled_request_leaves_no_half_written_entry(cached: ServerThread, fresh: ServerThread) -> None:
    history = [{"role": "user", "content": "Once upon a time"}]
    first = _turn(cached, history)
    assert metrics(cached)["aioexperts_prompt_cache_entries"] == 1
    history += [{"role": "assistant", "content": _reply(first)}, {"role": "user", "content": "Go on, at length"}]
    client = RawStream(
        cached, CHAT, {"messages": history, "max_tokens": 300, "temperature": 0, "stream": True}, key=None
    )
    try:
        client.read_until(b"data: ", 4)  # under way: the cached sequence is taken and being written
        assert metrics(cached)["aioexperts_prompt_cache_entries"] == 0
    finally:
        client.close()

    def settled() -> dict[str, float] | None:
        m = metrics(cached)
        return m if m["aioexperts_requests_running"] == 0 and m["aioexperts_sequences_live"] == 0 else None

    m = wait_for(settled)
    assert m["aioexperts_prompt_cache_entries"] == 0 and m["aioexperts_prompt_cache_bytes"] == 0
    again = _check_prefill(cached, history)
    assert _cached_tokens(again) == 0  # nothing of the cancelled request was reused
    assert _reply(again) == _reply(_turn(fresh, history))
