"""Many callers: a client that goes away stops its generation at once and frees its KV cache
(the server's metrics show it); a full queue is a 503 and the queue is first come first served;
a bounded load on loopback ends with no error and no leaked descriptor, sequence or KV cache."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aioexperts.serve import ServerOptions
from serve.conftest import openai
from serve.serving import API_KEY, RawStream, ServerThread, metrics, open_fds, post, request, wait_for

TEXT = "/v1/completions"
CHAT = "/v1/chat/completions"
LONG = {"prompt": "Tell me everything.", "max_tokens": 400, "temperature": 0}  # about 400 tokens: 10+ s here


def settled(served: ServerThread) -> dict[str, float]:
    """The metrics once nothing runs, waits or holds a KV cache (but the prompt cache's sequences)."""

    def idle() -> dict[str, float] | None:
        m = metrics(served)
        quiet = ("requests_running", "queue_depth")
        pooled = m["aioexperts_sequences_live"] == m["aioexperts_prompt_cache_entries"]
        pooled_bytes = m["aioexperts_kv_cache_bytes_in_use"] == m["aioexperts_prompt_cache_bytes"]
        return m if all(m["aioexperts_" + k] == 0 for k in quiet) and pooled and pooled_bytes else None

    return wait_for(idle, timeout=30)


def generated(served: ServerThread) -> float:
    return metrics(served)["aioexperts_completion_tokens_total"]


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "whole"])
def test_a_client_that_goes_away_stops_its_generation_and_frees_its_kv_cache(
    served: ServerThread, stream: bool
) -> None:
    before = settled(served)
    client = RawStream(served, TEXT, {**LONG, "stream": stream})
    try:
        if stream:
            client.read_until(b"data: ", 4)  # the generation is under way
        else:
            wait_for(lambda: generated(served) >= before["aioexperts_completion_tokens_total"] + 4)
        running = metrics(served)
        assert running["aioexperts_sequences_live"] - running["aioexperts_prompt_cache_entries"] == 1
        assert running["aioexperts_kv_cache_bytes_in_use"] > running["aioexperts_prompt_cache_bytes"]
        at_close = running["aioexperts_completion_tokens_total"]
    finally:
        client.close()
    after = settled(served)  # within 30 s; the whole generation would take about 10 s more
    assert after["aioexperts_requests_cancelled_total"] == before["aioexperts_requests_cancelled_total"] + 1
    gone = 'aioexperts_requests_total{endpoint="/v1/completions",status="499"}'
    assert after[gone] == before.get(gone, 0) + 1  # counted as "client closed request"
    stopped_at = after["aioexperts_completion_tokens_total"]
    assert stopped_at - at_close <= 3, "the generation went on after the client left"
    time.sleep(0.5)
    assert generated(served) == stopped_at
    assert stopped_at - before["aioexperts_completion_tokens_total"] < 100
    status, out = post(served, TEXT, {"prompt": "Hello", "max_tokens": 3, "temperature": 0})  # the next one is served
    assert status == 200 and out["usage"]["completion_tokens"] >= 1


@pytest.fixture
def one_slot(serve_model: Path) -> Iterator[ServerThread]:
    """A server of its own: one sequence at a time, two may wait, no API key."""
    thread = ServerThread(serve_model, ServerOptions(port=0, parallel=1, queue_size=2)).start()
    yield thread
    thread.stop()


def test_a_full_queue_is_503_and_the_queue_is_first_come_first_served(one_slot: ServerThread) -> None:
    running = RawStream(one_slot, TEXT, {**LONG, "stream": True}, key=None)
    running.read_until(b"data: ")
    finished: list[str] = []

    def queued(name: str) -> threading.Thread:
        def run() -> None:
            status, out = post(one_slot, TEXT, {"prompt": f"{name} says", "max_tokens": 3}, key=None)
            assert status == 200, out
            finished.append(name)

        t = threading.Thread(target=run)
        t.start()
        wait_for(lambda: metrics(one_slot)["aioexperts_queue_depth"] == len(name))
        return t

    # holds the slot for a while (48 tokens), long enough to look at the queue while it streams
    first = RawStream(one_slot, TEXT, {**LONG, "prompt": "a says", "max_tokens": 48, "stream": True}, key=None)
    wait_for(lambda: metrics(one_slot)["aioexperts_queue_depth"] == 1)
    second = queued("bb")  # queue depth 2
    status, body = post(one_slot, TEXT, {"prompt": "one too many", "max_tokens": 3}, key=None)
    assert status == 503 and body["error"]["code"] == "queue_full" and body["error"]["type"] == "server_error"
    assert "--queue 2" in body["error"]["message"]
    running.close()  # its slot goes to the first in line
    first.read_until(b"data: ")  # the first in line streams; the second still waits for the one slot
    assert not finished and metrics(one_slot)["aioexperts_queue_depth"] == 1
    assert b"[DONE]" in first.read_all()
    first.close()
    second.join(60)
    assert finished == ["bb"]
    after = settled(one_slot)
    assert after["aioexperts_requests_rejected_total"] == 1
    assert after['aioexperts_requests_total{endpoint="/v1/completions",status="503"}'] == 1
    assert after['aioexperts_requests_total{endpoint="/v1/completions",status="200"}'] == 2


def test_eight_clients_for_eight_seconds_no_error_no_leak(served: ServerThread) -> None:
    settled(served)
    fds_before = open_fds()
    before = metrics(served)
    errors: list[BaseException] = []
    done = [0] * 8
    stop_at = time.monotonic() + 8.0

    def client(i: int) -> None:
        try:
            with openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
                n = 0
                while time.monotonic() < stop_at:
                    kw: dict[str, Any] = {"model": "m", "max_tokens": 4, "temperature": 0.7, "seed": i * 1000 + n}
                    if n % 2:
                        if n % 4 == 1:
                            text = "".join(
                                ch.choices[0].text for ch in c.completions.create(prompt=f"{i}:{n}", stream=True, **kw)
                            )
                        else:
                            text = c.completions.create(prompt=f"{i}:{n}", **kw).choices[0].text
                    else:
                        msgs = [{"role": "user", "content": f"client {i} request {n}"}]
                        text = c.chat.completions.create(messages=msgs, **kw).choices[0].message.content or ""
                    assert isinstance(text, str)
                    n += 1
                done[i] = n
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert all(n >= 1 for n in done), done
    after = settled(served)
    ok = 'aioexperts_requests_total{endpoint="%s",status="200"}'
    served_now = sum(after.get(ok % ep, 0) - before.get(ok % ep, 0) for ep in (TEXT, CHAT))
    assert served_now == sum(done)
    assert not [k for k, v in after.items() if k.startswith("aioexperts_requests_total") and '"5' in k and v]
    assert wait_for(lambda: open_fds() <= fds_before + 1, timeout=10)  # the connections are closed


def test_sequences_decoded_together_give_the_tokens_each_gets_alone(served: ServerThread) -> None:
    prompts = ["The cat", "A long road", "Numbers: 1, 2,", "Hello <|im_start|>"]

    def complete(prompt: str) -> str:
        status, out = post(served, TEXT, {"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert status == 200, out
        return str(out["choices"][0]["text"])

    alone = [complete(p) for p in prompts]
    batched_before = metrics(served)["aioexperts_decode_steps_batched_total"]
    together: list[str | None] = [None] * len(prompts)

    def run(i: int) -> None:
        together[i] = complete(prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone
    assert len(set(alone)) > 1  # the prompts lead to different texts
    # they did decode together: steps that ran several sequences' tokens at once
    assert metrics(served)["aioexperts_decode_steps_batched_total"] > batched_before


def test_a_whole_request_cut_at_the_shutdown_deadline_gets_503_shutting_down(serve_model: Path) -> None:
    """Not streamed, cancelled by stop()'s deadline (0 s here: a fast CPU decodes 500 tokens of the
    test model within 1 s): a 503 error object with Connection: close, not a connection closed
    without an answer."""
    options = ServerOptions(port=0, parallel=1, queue_size=0)
    thread = ServerThread(serve_model, options, stop_grace=0.0).start()
    answer: list[tuple[int, dict[str, str], bytes]] = []
    body = {**LONG, "max_tokens": 500}
    client = threading.Thread(target=lambda: answer.append(request(thread, "POST", TEXT, body, key=None)))
    client.start()
    wait_for(lambda: metrics(thread)["aioexperts_completion_tokens_total"] > 0)
    thread.stop()
    client.join(30)
    assert answer, "no answer"
    status, headers, data = answer[0]
    assert status == 503 and headers.get("connection") == "close", (status, headers, data)
    assert json.loads(data)["error"]["code"] == "shutting_down"
    assert thread.cancelled_at_stop == 1


@pytest.mark.parametrize("path", [CHAT, "/v1/messages"])
def test_a_client_that_resets_the_connection_mid_stream_is_a_quiet_499(
    served: ServerThread, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Agents cancel replies: a reset at any point of a stream (the last events included) is counted
    as cancelled and 499, with no traceback in the log, and the next request is served."""
    import socket
    import struct

    caplog.set_level(logging.ERROR)
    before = settled(served)
    n = 12
    for i in range(n):
        body: dict[str, Any] = {"messages": [{"role": "user", "content": f"go {i}"}], "stream": True}
        body["max_tokens"] = 1 + i % 3  # short: the reset often lands on the last writes
        client = RawStream(served, path, body)
        client.read_until(b"data: ", 1 + i % 2)
        client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
        client.close()
    after = settled(served)
    gone = f'aioexperts_requests_total{{endpoint="{path}",status="499"}}'
    ok = f'aioexperts_requests_total{{endpoint="{path}",status="200"}}'
    assert after.get(gone, 0) - before.get(gone, 0) + after.get(ok, 0) - before.get(ok, 0) == n
    cancelled = after["aioexperts_requests_cancelled_total"] - before["aioexperts_requests_cancelled_total"]
    assert cancelled == after.get(gone, 0) - before.get(gone, 0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    status, out = post(served, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert status == 200 and out["usage"]["completion_tokens"] >= 1
