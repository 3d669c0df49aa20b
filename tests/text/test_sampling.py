"""Sampler (llama.cpp's chain), SamplingOptions checks and StopMatcher."""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from aioexperts import ConfigError, InvalidRequestError, Sampler, SamplingOptions
from aioexperts._text.sampling import StopMatcher, end_of_generation_ids, stop_reason

PLAIN = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0}

logit_arrays = arrays(
    np.float32,
    st.integers(2, 300),
    elements=st.floats(-20, 20, width=32, allow_nan=False, allow_infinity=False),
)


def _softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def _rank(logits: np.ndarray, token: int) -> int:
    """How many tokens have a strictly larger logit (0 for the best)."""
    return int((logits > logits[token]).sum())


def test_the_same_seed_gives_the_same_tokens() -> None:
    rng = np.random.default_rng(0)
    steps = [rng.standard_normal(5000).astype(np.float32) * 2 for _ in range(40)]
    runs = []
    for seed in (7, 7, 8):
        sampler = Sampler(SamplingOptions(seed=seed, top_k=0, top_p=0.9, min_p=0.01, temperature=1.2))
        history: list[int] = []
        for logits in steps:
            history.append(sampler(logits, history))
        runs.append(history)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_greedy_takes_the_largest_penalized_logit() -> None:
    logits = np.array([1.0, 5.0, 4.9, -3.0], dtype=np.float32)
    assert Sampler(SamplingOptions(temperature=0))(logits, []) == 1
    # 5.0 / 1.1 = 4.545 < 4.9: the repeat penalty moves the choice to token 2
    assert Sampler(SamplingOptions(temperature=0, repeat_penalty=1.1))(logits, [1]) == 2
    # only the last penalty_last_n tokens count
    assert Sampler(SamplingOptions(temperature=0, repeat_penalty=1.1, penalty_last_n=1))(logits, [1, 0]) == 1


def _reference_penalties(logits: np.ndarray, history: list[int], opts: SamplingOptions) -> np.ndarray:
    """llama_sampler_penalties_apply, one token at a time."""
    out = logits.astype(np.float32).copy()
    window = history if opts.penalty_last_n < 0 else history[max(0, len(history) - opts.penalty_last_n) :]
    for token in set(window):
        count = window.count(token)
        if out[token] <= 0:
            out[token] *= np.float32(opts.repeat_penalty)
        else:
            out[token] /= np.float32(opts.repeat_penalty)
        out[token] -= np.float32(count * opts.frequency_penalty + opts.presence_penalty)
    return out


@settings(max_examples=150, deadline=None)
@given(
    logits=logit_arrays,
    data=st.data(),
    repeat=st.floats(0.5, 2.0),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    last_n=st.integers(-1, 20),
)
def test_penalties_follow_llama_cpp(
    logits: np.ndarray, data: st.DataObject, repeat: float, presence: float, frequency: float, last_n: int
) -> None:
    history = data.draw(st.lists(st.integers(0, logits.size - 1), max_size=30))
    opts = SamplingOptions(
        temperature=0,
        repeat_penalty=repeat,
        presence_penalty=presence,
        frequency_penalty=frequency,
        penalty_last_n=last_n,
    )
    want = _reference_penalties(logits, history, opts) if last_n != 0 else logits
    assert Sampler(opts)(logits, history) == int(np.argmax(want))


@settings(max_examples=200, deadline=None)
@given(logits=logit_arrays, k=st.integers(1, 50), seed=st.integers(0, 2**32))
def test_top_k_never_picks_outside_the_k_largest(logits: np.ndarray, k: int, seed: int) -> None:
    sampler = Sampler(SamplingOptions(**{**PLAIN, "top_k": k}, seed=seed))
    for _ in range(5):
        assert _rank(logits, sampler(logits, [])) < k


@settings(max_examples=200, deadline=None)
@given(logits=logit_arrays, p=st.floats(0.01, 0.99), seed=st.integers(0, 2**32), temperature=st.floats(0.1, 3))
def test_top_p_never_picks_outside_the_nucleus(logits: np.ndarray, p: float, seed: int, temperature: float) -> None:
    sampler = Sampler(SamplingOptions(**{**PLAIN, "top_p": p, "temperature": temperature}, seed=seed))
    probs = np.sort(_softmax64(logits))[::-1]
    # the shortest prefix reaching p (float32 sums may differ from float64 by a little: allow 1e-5)
    nucleus = int(np.searchsorted(np.cumsum(probs), p + 1e-5, side="left")) + 1
    for _ in range(5):
        assert _rank(logits, sampler(logits, [])) < nucleus


@settings(max_examples=200, deadline=None)
@given(logits=logit_arrays, p=st.floats(0.001, 1.0), seed=st.integers(0, 2**32), temperature=st.floats(0.1, 3))
def test_min_p_never_picks_a_token_below_p_times_the_best(
    logits: np.ndarray, p: float, seed: int, temperature: float
) -> None:
    sampler = Sampler(SamplingOptions(**{**PLAIN, "min_p": p, "temperature": temperature}, seed=seed))
    for _ in range(5):
        token = sampler(logits, [])
        assert logits[token] >= logits.max() + math.log(p) - 1e-5


@settings(max_examples=100, deadline=None)
@given(logits=logit_arrays, k=st.integers(1, 20), p=st.floats(0.05, 0.99), min_p=st.floats(0.0, 0.5))
def test_the_chain_picks_inside_every_set(logits: np.ndarray, k: int, p: float, min_p: float) -> None:
    sampler = Sampler(SamplingOptions(top_k=k, top_p=p, min_p=min_p, temperature=0.7, seed=1))
    token = sampler(logits, [])
    assert _rank(logits, token) < k
    assert logits[token] >= logits.max() + math.log(max(min_p, 1e-30)) - 1e-5


def test_draws_follow_the_softmax_with_temperature() -> None:
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    temperature = 0.7
    sampler = Sampler(SamplingOptions(**{**PLAIN, "temperature": temperature}, seed=3))
    n = 20000
    counts = np.bincount([sampler(logits, []) for _ in range(n)], minlength=4)
    want = _softmax64(logits / temperature) * n
    chi2 = float(((counts - want) ** 2 / want).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


def test_top_p_of_a_large_flat_vocabulary_sorts_beyond_256() -> None:
    """Tokens beyond the first 256 can be drawn when those do not reach p (the adaptive sort grows)."""
    logits = np.zeros(151936, dtype=np.float32)
    sampler = Sampler(SamplingOptions(**{**PLAIN, "top_p": 0.9}, seed=0))
    picks = {sampler(logits, []) for _ in range(50)}
    assert len(picks) > 40 and max(picks) > 1000


def test_logprobs_are_the_models_log_softmax() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(1000).astype(np.float32) * 3
    sampler = Sampler(SamplingOptions(logprobs=5, seed=2, repeat_penalty=1.5, temperature=2.0))
    token = sampler(logits, [int(np.argmax(logits))])
    last = sampler.last
    assert last is not None and last.token == token
    want = np.log(_softmax64(logits))
    assert last.logprob == pytest.approx(want[token], abs=1e-4)
    assert [i for i, _ in last.top_logprobs] == list(np.argsort(-logits)[:5])
    assert [lp for _, lp in last.top_logprobs] == pytest.approx(list(np.sort(want)[::-1][:5]), abs=1e-4)
    no_logprobs = Sampler(SamplingOptions(seed=2))
    no_logprobs(logits, [])
    assert no_logprobs.last is not None and no_logprobs.last.logprob is None and no_logprobs.last.top_logprobs == ()


def test_masked_tokens_are_never_picked() -> None:
    logits = np.full(100, -np.inf, dtype=np.float32)
    logits[[3, 50]] = [0.0, 0.5]
    sampler = Sampler(SamplingOptions(**PLAIN, seed=0))
    assert {sampler(logits, []) for _ in range(100)} == {3, 50}


@pytest.mark.parametrize(
    ("logits", "needle"),
    [
        (np.array([0.0, np.nan], dtype=np.float32), "NaN"),
        (np.array([0.0, np.inf], dtype=np.float32), r"\+inf"),
        (np.full(3, -np.inf, dtype=np.float32), "every logit is -inf"),
        (np.zeros((2, 3), dtype=np.float32), "1-D"),
        (np.zeros(0, dtype=np.float32), "non-empty"),
        (np.zeros(3, dtype=np.int32), "float"),
        ([0, 1], "float"),
        ([[0.0, 1.0]], "1-D"),
        ([0.0, [1.0]], "1-D float array"),
        ("0.0", "1-D float array"),
        ([], "non-empty"),
    ],
)
def test_bad_logits_are_refused(logits: object, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        Sampler(SamplingOptions(seed=0))(logits, [])  # type: ignore[arg-type]


def test_logits_may_be_any_float_array_like() -> None:
    """A list of floats or a float64 array, as numpy APIs take them: the same token as float32 logits."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(50).astype(np.float32)
    for options in (SamplingOptions(temperature=0.0), SamplingOptions(seed=7)):
        want = Sampler(options)(logits, [1, 2])
        assert Sampler(options)(logits.tolist(), [1, 2]) == want
        assert Sampler(options)(logits.astype(np.float64), [1, 2]) == want


@pytest.mark.parametrize("history", [[5], [-1], [0, 99999]])
def test_history_ids_outside_the_vocabulary_are_refused(history: list[int]) -> None:
    sampler = Sampler(SamplingOptions(repeat_penalty=1.1, seed=0))
    with pytest.raises(InvalidRequestError, match=r"outside \[0, 5\)"):
        sampler(np.zeros(5, dtype=np.float32), history)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_k", -1),
        ("top_k", 2.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.01),
        ("repeat_penalty", 0.0),
        ("presence_penalty", math.inf),
        ("frequency_penalty", "1"),
        ("penalty_last_n", -2),
        ("seed", -1),
        ("seed", 2**64),
        ("logprobs", 101),
        ("logprobs", True),
        ("max_tokens", 0),
        ("stop", "END"),
        ("stop", ("",)),
    ],
)
def test_options_out_of_range_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"SamplingOptions.{field}"):
        SamplingOptions(**{field: value})  # type: ignore[arg-type]


def test_options_are_frozen_and_stop_lists_become_tuples() -> None:
    opts = SamplingOptions(stop=["a", "b"])  # type: ignore[arg-type]
    assert opts.stop == ("a", "b")
    with pytest.raises(AttributeError):
        opts.top_k = 3  # type: ignore[misc]


def test_a_stop_string_split_across_pieces_is_caught_and_not_emitted() -> None:
    matcher = StopMatcher(["<|im_end|>", "\n\nUser:"])
    pieces = ["Hello", " world", "<|", "im", "_e", "nd", "|>", "more"]
    emitted = [matcher.feed(p) for p in pieces]
    assert "".join(emitted) == "Hello world"
    assert emitted[2:] == ["", "", "", "", "", ""]
    assert matcher.stopped and matcher.stop_string == "<|im_end|>"
    assert matcher.flush() == ""


def test_a_false_start_of_a_stop_string_is_emitted_once_it_cannot_match() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("a ST") == "a "
    assert matcher.feed("AR") == "STAR"
    assert matcher.feed("ST") == ""
    assert matcher.flush() == "ST"
    assert not matcher.stopped


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abcS TOP<|>", max_size=40),
    stops=st.lists(st.text(alphabet="abS TOP<|>", min_size=1, max_size=5), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_stop_matcher_emits_exactly_the_text_before_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    matcher = StopMatcher(stops)
    out = "".join(matcher.feed(p) for p in pieces) + matcher.flush()
    # the piece that completes the first stop string ends at the first bound whose prefix holds one;
    # the text is cut at the earliest stop string in that prefix
    seen = next((text[:b] for b in bounds if any(s in text[:b] for s in stops)), None)
    if seen is None:
        assert out == text and not matcher.stopped
    else:
        assert matcher.stopped
        assert out == text[: min(seen.find(s) for s in stops if s in seen)]
        assert all(s not in out for s in stops)


def test_stop_matcher_refuses_empty_stop_strings() -> None:
    with pytest.raises(ConfigError):
        StopMatcher([""])
    with pytest.raises(ConfigError):
        StopMatcher("abc")


def test_end_of_generation_ids_and_stop_reasons() -> None:
    meta = {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.bos_token_id": 1}
    eog = end_of_generation_ids(meta)
    assert eog == {2, 7}
    opts = SamplingOptions(max_tokens=3)
    assert stop_reason(7, 1, eog, opts) == "eog"
    assert stop_reason(5, 2, eog, opts) is None
    assert stop_reason(5, 3, eog, opts) == "length"


def test_end_of_generation_ids_by_text_as_llama_cpp() -> None:
    texts = ["a", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<｜end▁of▁sentence｜>", "<|fim_pad|>"]
    meta = {"tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.fim_pad_token_id": 5}
    assert end_of_generation_ids(meta) == {1, 5}
    assert end_of_generation_ids(meta, texts) == {1, 3, 4, 5}
    assert end_of_generation_ids({"tokenizer.ggml.eos_token_id": True}) == frozenset()


@pytest.mark.parametrize("temperature", [0.0, 1e-45, 1e-40, float(np.finfo(np.float32).tiny) / 2])
def test_a_temperature_below_float32s_smallest_normal_is_greedy_without_warnings(temperature: float) -> None:
    """``--temp 1e-45`` divided the logits by a denormal: divide-by-zero and invalid warnings, NaN
    probabilities. Below GREEDY_BELOW the sampler takes the largest logit, as at 0."""
    logits = np.array([3.0, -1e30, 250.0, 249.0, -np.inf], dtype=np.float32)
    with np.errstate(divide="raise", over="raise", invalid="raise"):  # numpy warns of these by default
        for seed in range(20):
            assert Sampler(SamplingOptions(**{**PLAIN, "temperature": temperature, "seed": seed}))(logits, []) == 2


@pytest.mark.parametrize("temperature", [float(np.finfo(np.float32).tiny), 1e-30, 1e-6])
def test_a_small_temperature_above_the_greedy_bound_draws_without_nan(temperature: float) -> None:
    """The largest logit is subtracted before the temperature divides: large logits over a small
    temperature send the others to probability 0 (no overflow warning, no inf - inf = NaN)."""
    logits = np.array([3.0, -1e30, 250.0, 249.0, -np.inf], dtype=np.float32)
    with np.errstate(divide="raise", over="raise", invalid="raise"):  # numpy warns of these by default
        for seed in range(20):
            assert Sampler(SamplingOptions(**{**PLAIN, "temperature": temperature, "seed": seed}))(logits, []) == 2


def test_the_largest_temperature_is_float32s_largest_and_the_message_says_the_range() -> None:
    """``--temp 1e39`` overflowed in the float32 cast; ``-1`` was said to be outside ``[0.0, inf]``
    while ``inf`` was refused too. The range said is the range accepted."""
    top = float(np.finfo(np.float32).max)
    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    with np.errstate(divide="raise", over="raise", invalid="raise"):  # numpy warns of these by default
        drawn = {Sampler(SamplingOptions(**{**PLAIN, "temperature": top, "seed": s}))(logits, []) for s in range(60)}
    assert drawn == {0, 1, 2}  # all but uniform
    for bad in (-1.0, 1e39, top * (1 + 2**-52)):
        message = f"SamplingOptions.temperature={bad!r} is outside [0.0, float32's largest (3.4e38)]"
        assert top == 3.4028234663852886e38  # the number the message names
        with pytest.raises(ConfigError, match=re.escape(message)):
            SamplingOptions(temperature=bad)
    with pytest.raises(ConfigError, match="SamplingOptions.temperature must be a finite number, got inf"):
        SamplingOptions(temperature=math.inf)


@pytest.mark.parametrize("penalty", [3.0e38, 1e300, -3.0e38, -1e300])
def test_penalties_past_float32s_range_keep_the_logits_finite(penalty: float) -> None:
    logits = np.array([5.0, 4.0, 3.0, -1.0], dtype=np.float32)
    history = [0, 0, 3]
    for opts in (
        SamplingOptions(temperature=0, presence_penalty=penalty),
        SamplingOptions(temperature=0, frequency_penalty=penalty, presence_penalty=penalty),
        SamplingOptions(temperature=1.0, seed=1, frequency_penalty=penalty),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no overflow warning from numpy
            token = Sampler(opts)(logits, history)
        # a huge positive penalty pushes the penalized tokens (0, 3) to the bottom, a negative one to the top
        assert token in ((1, 2) if penalty > 0 else (0, 3))
    assert Sampler(SamplingOptions(temperature=0, repeat_penalty=1e-300))(logits, history) == 0  # 5 / tiny: largest
