"""Token sampling with llama.cpp's semantics, in vectorized numpy.

The chain is llama.cpp's default order (``common/sampling.cpp``; each step in
``src/llama-sampler.cpp``): penalties -> top-k -> top-p -> min-p -> temperature -> dist.

- **penalties** (``llama_sampler_penalties_apply``): for each token seen ``c > 0`` times in the
  last ``penalty_last_n`` tokens of the history, ``logit = logit * repeat_penalty`` if
  ``logit <= 0`` else ``logit / repeat_penalty``, then ``logit -= c * frequency_penalty +
  presence_penalty``.
- **top-k** (``llama_sampler_top_k_impl``): keep the ``k`` largest logits (``k <= 0``: all), sorted
  in descending order.
- **top-p** (``llama_sampler_top_p_apply``): softmax over the candidates, keep the shortest
  descending prefix whose cumulative probability reaches ``p`` (``p >= 1``: all).
- **min-p** (``llama_sampler_min_p_apply``): keep the candidates with ``logit >= max_logit +
  log(p)``, i.e. ``prob >= p * max_prob`` (``p <= 0``: all).
- **temperature** (``llama_sampler_temp_impl``): divide the logits by ``temperature``;
  ``temperature == 0`` is greedy: the largest penalized logit, nothing is drawn. So is a temperature
  below :data:`GREEDY_BELOW` (float32's smallest normal number, about ``1.2e-38``), which float32
  logits cannot be divided by usefully; one above float32's largest number (about ``3.4e38``) is
  refused.
- **dist** (``llama_sampler_dist_apply``): softmax over what is left, draw ``u`` uniform in
  ``[0, 1)`` and take the first candidate whose running sum of probabilities reaches ``u * sum``.
  The generator is numpy's PCG64 seeded with ``seed`` (not llama.cpp's mt19937, so the tokens drawn
  differ from llama.cpp's for the same seed; the same seed gives the same tokens here).

Log-probabilities (``logprobs > 0``) are those of the model: ``log_softmax`` of the logits before
penalties and temperature, as llama.cpp's server reports them (``n_probs``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import ConfigError, InvalidRequestError

__all__ = (
    "EOG_TEXTS",
    "SampledToken",
    "Sampler",
    "SamplingOptions",
    "StopMatcher",
    "end_of_generation_ids",
    "stop_reason",
)

#: A temperature below this (float32's smallest normal number, about 1.2e-38) samples greedily, as 0.
GREEDY_BELOW = float(np.finfo(np.float32).tiny)
#: The largest temperature (float32's largest number, about 3.4e38): float32 logits are divided by it.
MAX_TEMPERATURE = float(np.finfo(np.float32).max)

# llama_sampler_top_p_apply sorts the best 256 first and only sorts everything when they do not reach p;
# here the set grows 16-fold until it does
_TOP_P_FIRST_SORT = 256


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """How the next token is chosen, and when generation stops (llama.cpp's defaults).

    Attributes:
        temperature: ``0 <= temperature <=`` :data:`MAX_TEMPERATURE` (about ``3.4e38``); 0, and
            anything below :data:`GREEDY_BELOW` (about ``1.2e-38``), is greedy.
        top_k: ``>= 0``; 0 keeps every token.
        top_p: in ``(0, 1]``; 1 keeps every token.
        min_p: in ``[0, 1]``; 0 keeps every token.
        repeat_penalty: ``> 0``; 1 is off.
        presence_penalty: subtracted once from each token of the penalty window (any finite float; 0
            is off; a logit it would push past float32's range stops at float32's largest magnitude).
        frequency_penalty: subtracted per occurrence in the penalty window (any finite float; 0 is
            off; as ``presence_penalty`` past float32's range).
        penalty_last_n: tokens of the history the penalties look at; ``-1`` all, 0 none.
        seed: seed of the random draws (``0 <= seed < 2**64``); None draws a fresh seed.
        logprobs: report the log-probabilities of the ``logprobs`` most likely tokens with each
            chosen token (``0 <= logprobs <= 100``; 0 is off).
        max_tokens: stop after this many generated tokens (``>= 1``).
        stop: strings that end generation when the text contains one; they are not emitted.

    Raises:
        ConfigError: a field is out of range; the message names it and the range.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    logprobs: int = 0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        def number(name: str, low: float, high: float, *, low_open: bool = False) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"SamplingOptions.{name} must be a finite number, got {value!r}")
            if value < low or value > high or (low_open and value == low):
                lo = "(" if low_open else "["
                top = "float32's largest (3.4e38)]" if high == MAX_TEMPERATURE else f"{high}]"
                top = "inf)" if high == math.inf else top  # finite numbers only
                raise ConfigError(f"SamplingOptions.{name}={value!r} is outside {lo}{low}, {top}")

        def integer(name: str, low: int, high: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"SamplingOptions.{name} must be an int, got {value!r}")
            if not low <= value <= high:
                raise ConfigError(f"SamplingOptions.{name}={value} is outside [{low}, {high}]")

        number("temperature", 0.0, MAX_TEMPERATURE)
        integer("top_k", 0, 2**31 - 1)
        number("top_p", 0.0, 1.0, low_open=True)
        number("min_p", 0.0, 1.0)
        number("repeat_penalty", 0.0, math.inf, low_open=True)
        number("presence_penalty", -math.inf, math.inf)
        number("frequency_penalty", -math.inf, math.inf)
        integer("penalty_last_n", -1, 2**31 - 1)
        if self.seed is not None:
            integer("seed", 0, 2**64 - 1)
        integer("logprobs", 0, 100)
        integer("max_tokens", 1, 2**31 - 1)
        if isinstance(self.stop, str) or not isinstance(self.stop, tuple | list):
            raise ConfigError(f"SamplingOptions.stop must be a tuple of strings, got {self.stop!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"SamplingOptions.stop must hold non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One chosen token.

    Attributes:
        token: the token id.
        logprob: its log-probability under the model (natural log; None unless ``logprobs > 0``).
        top_logprobs: the ``logprobs`` most likely ``(token id, logprob)`` pairs, most likely first
            (empty unless asked for).
    """

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Chooses the next token from logits (llama.cpp's chain; see the module docstring).

    ``sampler(logits, history)`` gives the token id; ``sampler.last`` then holds the
    :class:`SampledToken` with its log-probabilities. A sampler holds its random generator: one per
    generation, so that the same seed gives the same tokens.

    Args:
        options: the sampling options (default :class:`SamplingOptions`).

    Raises:
        ConfigError: ``options`` is not a :class:`SamplingOptions`.
    """

    __slots__ = ("_rng", "last", "options")

    def __init__(self, options: SamplingOptions | None = None) -> None:
        if options is None:
            options = SamplingOptions()
        if not isinstance(options, SamplingOptions):
            raise ConfigError(f"Sampler needs SamplingOptions, got {type(options).__name__}")
        self.options = options
        self._rng = np.random.Generator(np.random.PCG64(options.seed))
        self.last: SampledToken | None = None

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """The next token id.

        Args:
            logits: float32 ``(n_vocab,)``, the model's logits for the next token (``-inf`` masks a
                token). Not modified.
            history: the token ids so far (prompt and generated), oldest first; the penalties read
                its last ``penalty_last_n``.

        Returns:
            The chosen token id, in ``[0, n_vocab)``.

        Raises:
            InvalidRequestError: ``logits`` is not a 1-D float array, holds NaN or +inf or only
                ``-inf``; a history id is outside ``[0, n_vocab)``.
        """
        chosen = self.sample(logits, history)
        return chosen.token

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> SampledToken:
        """Like calling the sampler, but gives the :class:`SampledToken` (also kept as ``last``)."""
        raw = _check_logits(logits)
        opts = self.options
        work = _penalized(raw, history, opts)
        if opts.temperature < GREEDY_BELOW:
            token = int(np.argmax(work))
        else:
            token = self._draw(work)
        self.last = _with_logprobs(raw, token, opts.logprobs)
        return self.last

    def _draw(self, work: np.ndarray) -> int:
        opts = self.options
        ids = _top_k(work, opts.top_k)  # descending when top_k > 0, else None (all, in id order)
        if opts.top_p < 1.0:
            ids = _top_p(work, ids, opts.top_p)
        if opts.min_p > 0.0:
            ids = _min_p(work, ids, opts.min_p)
        cand = work if ids is None else work[ids]
        # the largest logit first, then the temperature: a small temperature sends the others to
        # -inf (probability 0), never the largest to inf (inf - inf is NaN)
        with np.errstate(over="ignore"):
            scaled = (cand - cand.max()) / np.float32(opts.temperature)
        probs = np.exp(scaled, dtype=np.float32)
        cum = np.cumsum(probs, dtype=np.float64)
        target = cum[-1] * self._rng.random()
        pick = min(int(np.searchsorted(cum, target, side="left")), len(cum) - 1)
        return pick if ids is None else int(ids[pick])


def _check_logits(logits: object) -> np.ndarray:
    if not isinstance(logits, np.ndarray) and not isinstance(logits, str | bytes) and logits is not None:
        try:  # any float array-like (a list of floats), as numpy APIs take it
            logits = np.asarray(logits)
        except (ValueError, TypeError, OverflowError):
            pass  # refused below
    if not isinstance(logits, np.ndarray) or logits.ndim != 1 or logits.size == 0 or logits.dtype.kind != "f":
        shape = getattr(logits, "shape", None)
        dtype = getattr(logits, "dtype", type(logits).__name__)
        raise InvalidRequestError(f"logits must be a non-empty 1-D float array (n_vocab,), got {dtype} {shape}")
    arr = logits.astype(np.float32, copy=False)
    top = float(arr.max()) if not np.isnan(arr).any() else math.nan
    if math.isnan(top) or top == math.inf:
        raise InvalidRequestError(f"logits hold NaN or +inf (max {top}); the forward pass went wrong")
    if top == -math.inf:
        raise InvalidRequestError("every logit is -inf: no token can be chosen")
    return arr


def _penalized(raw: np.ndarray, history: Sequence[int], opts: SamplingOptions) -> np.ndarray:
    off = opts.repeat_penalty == 1.0 and opts.presence_penalty == 0.0 and opts.frequency_penalty == 0.0
    if off or opts.penalty_last_n == 0 or len(history) == 0:
        return raw
    window = history if opts.penalty_last_n < 0 else history[-opts.penalty_last_n :]
    seen = np.asarray(window, dtype=np.int64)
    if seen.ndim != 1 or (seen.size and (int(seen.min()) < 0 or int(seen.max()) >= raw.size)):
        raise InvalidRequestError(f"history holds token ids outside [0, {raw.size})")
    ids, counts = np.unique(seen, return_counts=True)
    out = raw.copy()
    original = out[ids]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # huge penalties: mended below
        repeat = np.float32(opts.repeat_penalty)
        values = np.where(original <= 0, original * repeat, original / repeat)
        values -= counts.astype(np.float32) * np.float32(opts.frequency_penalty) + np.float32(opts.presence_penalty)
    bad = ~np.isfinite(values)
    if bad.any():  # a penalty past float32's range: the same formula in float64, kept within float32
        o, c = original[bad].astype(np.float64), counts[bad].astype(np.float64)
        wide = np.where(o <= 0, o * opts.repeat_penalty, o / opts.repeat_penalty)
        wide -= c * opts.frequency_penalty + opts.presence_penalty
        top = float(np.finfo(np.float32).max)
        values[bad] = np.clip(np.nan_to_num(wide, nan=0.0, posinf=top, neginf=-top), -top, top)
    out[ids] = values
    return out


def _top_k(work: np.ndarray, k: int) -> np.ndarray | None:
    if k <= 0 or k >= work.size:
        return None if k <= 0 else _descending(work, np.arange(work.size))
    part = np.argpartition(work, work.size - k)[work.size - k :]
    return _descending(work, part)


def _descending(work: np.ndarray, ids: np.ndarray) -> np.ndarray:
    # stable on -logit: equal logits keep id order, so a seed always gives the same order
    return ids[np.argsort(-work[ids], kind="stable")]


def _top_p(work: np.ndarray, ids: np.ndarray | None, p: float) -> np.ndarray:
    cand = work if ids is None else work[ids]
    probs = np.exp(cand - cand.max(), dtype=np.float32)
    probs /= probs.sum(dtype=np.float32)
    if ids is None:
        # the best 256 first; everything only if they do not reach p (as llama_sampler_top_p_apply)
        n_first = _TOP_P_FIRST_SORT
        while True:
            if n_first >= work.size:
                order = np.argsort(-cand, kind="stable")
                break
            first = np.argpartition(cand, cand.size - n_first)[cand.size - n_first :]
            order = first[np.argsort(-cand[first], kind="stable")]
            if float(probs[order].sum(dtype=np.float32)) >= p:
                break
            n_first *= 16  # 256, 4096, 65536, then everything
        ids, sorted_probs = order, probs[order]
    else:
        sorted_probs = probs
    cum = np.cumsum(sorted_probs, dtype=np.float32)
    last = int(np.searchsorted(cum, np.float32(p), side="left")) + 1
    return ids[: min(last, len(ids))]


def _min_p(work: np.ndarray, ids: np.ndarray | None, p: float) -> np.ndarray:
    cand = work if ids is None else work[ids]
    keep = cand >= cand.max() + np.float32(math.log(p))
    kept = np.flatnonzero(keep)
    return kept if ids is None else ids[kept]


def _with_logprobs(raw: np.ndarray, token: int, n: int) -> SampledToken:
    if n == 0:
        return SampledToken(token)
    shifted = raw - raw.max()
    log_norm = np.float32(np.log(np.exp(shifted, dtype=np.float32).sum(dtype=np.float64)))
    n = min(n, raw.size)
    top = np.argpartition(raw, raw.size - n)[raw.size - n :] if n < raw.size else np.arange(raw.size)
    top = top[np.argsort(-raw[top], kind="stable")]
    pairs = tuple((int(i), float(shifted[i] - log_norm)) for i in top)
    return SampledToken(token, float(shifted[token] - log_norm), pairs)


#: Token texts llama.cpp treats as end of generation whatever the keys say (``llama_vocab::impl::load``,
#: ``special_eog_ids`` in src/llama-vocab.cpp).
EOG_TEXTS = frozenset(
    (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    )
)  # fmt: skip

_EOG_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")


def end_of_generation_ids(metadata: Mapping[str, object], token_texts: Sequence[str] | None = None) -> frozenset[int]:
    """The ids that end generation, as llama.cpp's ``special_eog_ids`` (src/llama-vocab.cpp).

    From the keys ``tokenizer.ggml.{eos,eot,eom,fim_pad,fim_rep,fim_sep}_token_id``, and, when the
    vocabulary's texts are given, every token whose text is in :data:`EOG_TEXTS` (so ``<|im_end|>``
    ends a Qwen chat turn although the file's EOS is ``<|endoftext|>``). llama.cpp also finds the
    FIM tokens by their text when their keys are absent; that is not done here.

    Args:
        metadata: the header's metadata (``read_header(path).metadata`` or ``GGUFModel.metadata``).
        token_texts: ``tokenizer.ggml.tokens`` decoded, or None to use the keys only.

    Returns:
        The ids (possibly none).
    """
    out = set()
    for key in _EOG_KEYS:
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            out.add(value)
    if token_texts is not None:
        out.update(i for i, text in enumerate(token_texts) if text in EOG_TEXTS)
    return frozenset(out)


class StopMatcher:
    """Finds stop strings in streamed text pieces, across piece boundaries, and never emits them.

    ``feed(piece)`` gives the text that is safe to emit now: it holds back the longest tail that
    could be the start of a stop string. Once a stop string is complete, ``stopped`` is True,
    ``feed`` gives the text before it and then only ``""``. At the end of generation ``flush()``
    gives the held-back tail.

    Args:
        stop: the stop strings (non-empty).

    Raises:
        ConfigError: a stop string is empty or not a string.
    """

    __slots__ = ("_held", "_longest", "stop", "stopped", "stop_string")

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str) or any(not isinstance(s, str) or not s for s in stop):
            raise ConfigError(f"stop must be a sequence of non-empty strings, got {stop!r}")
        self.stop = tuple(stop)
        self._longest = max((len(s) for s in self.stop), default=0)
        self._held = ""
        self.stopped = False
        self.stop_string: str | None = None

    def feed(self, piece: str) -> str:
        """Add a piece of generated text; the text that can be emitted now (maybe ``""``)."""
        if self.stopped:
            return ""
        text = self._held + piece
        first = None
        for s in self.stop:
            at = text.find(s)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, s)
        if first is not None:
            self.stopped = True
            self.stop_string = first[1]
            self._held = ""
            return text[: first[0]]
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """The held-back text when generation ends without a stop string (``""`` after a stop)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def stop_reason(token: int, n_generated: int, eog_ids: frozenset[int], options: SamplingOptions) -> str | None:
    """Why generation ends after ``token``, if it does: ``"eog"`` (an end-of-generation id: it is not
    emitted), ``"length"`` (``n_generated`` reached ``options.max_tokens``; the token is emitted), else None.

    Stop strings are the :class:`StopMatcher`'s job (``"stop"``)."""
    if token in eog_ids:
        return "eog"
    if n_generated >= options.max_tokens:
        return "length"
    return None
