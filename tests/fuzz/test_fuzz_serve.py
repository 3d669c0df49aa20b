"""Door (d): the server's request validation (``parse_json``, ``parse_chat``, ``parse_completion``).

Raw bytes through the JSON step, and any JSON value as a body: the result is a checked request or an
``APIError`` with a 4xx status whose OpenAI-style error object serialises as JSON; never another
exception (which the server would answer with a bare 500).
"""

from __future__ import annotations

import json
import random

import fuzzkit as kit
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from aioexperts.serve._errors import APIError
from aioexperts.serve._validate import parse_chat, parse_completion, parse_json

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**400),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
)
field_names = st.sampled_from(sorted(kit._FIELDS))
extras = st.dictionaries(field_names, json_values, max_size=4)
bodies = st.one_of(
    json_values,
    st.dictionaries(field_names, json_values, max_size=8),
    st.builds(lambda extra: {"messages": [{"role": "user", "content": "hi"}], **extra}, extras),
    st.builds(lambda extra: {"prompt": "Once", **extra}, extras),
)


def _run(door: object, value: object) -> None:
    try:
        event(door(value))  # type: ignore[operator]
    except kit.Unexpected as exc:
        raise exc.cause from exc


@kit.FUZZ
@given(body=bodies)
def test_fuzz_parsed_bodies(body: object) -> None:
    _run(kit.serve_value_door, body)


@kit.FUZZ
@given(raw=st.one_of(st.binary(max_size=128), bodies.map(lambda b: json.dumps(b).encode())))
def test_fuzz_raw_bodies(raw: bytes) -> None:
    _run(kit.serve_door, raw)


@kit.FUZZ
@given(rnd=st.randoms(use_true_random=False))
def test_fuzz_generated_bodies(rnd: random.Random) -> None:
    """Plausible requests with odd fields, mangled bytes, other encodings, deep nesting, huge integers."""
    _run(kit.serve_door, kit.encode_body(rnd, kit.random_body(rnd)))


# regressions the fuzzer found


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"a":' * 100_000])
def test_deeply_nested_body_is_a_400(raw: bytes) -> None:
    """json.loads raised RecursionError, which the server answered with a bare 500."""
    with pytest.raises(APIError) as info:
        parse_json(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty"])
@pytest.mark.parametrize("value", [10**400, -(10**400), 2**1024], ids=["1e400", "-1e400", "2**1024"])
def test_integer_beyond_float_range_is_a_400(name: str, value: int) -> None:
    """math.isfinite raised OverflowError for a JSON integer past float's range (a bare 500)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], name: value}
    completion = {"prompt": "x", name: value}
    for parse, body in ((parse_chat, chat), (parse_completion, completion)):
        with pytest.raises(APIError) as info:
            parse(parse_json(json.dumps(body).encode()))
        assert info.value.status == 400 and info.value.param == name
