"""A built-in full model: every tensor of a Qwen3-30B-A3B-shaped ``qwen3moe`` GGUF, random weights.

For trying the whole-model path (tokenizer, chat template, forward pass, sampling) without a
download. The weights are random, so **the generated text is random**; only the shapes, types,
keys and the numbers' scale are those of a real model:

- attention (``attn_q``/``attn_k``/``attn_v``/``attn_output``), the token embedding and the output
  head are ``Q8_0``; norms (``attn_norm``, per-head ``attn_q_norm``/``attn_k_norm``, ``ffn_norm``,
  ``output_norm``) and the router (``ffn_gate_inp``) are ``F32``; the routed experts are ``Q4_K``,
  like the MoE-only bench model. (llama.cpp's Q4_K_M would use Q4_K with Q6_K for ``attn_v`` and
  the head; Q8_0 is used here because the quantized-block pool of :mod:`aioexperts.testing._blocks` has it.)
- the routers (``ffn_gate_inp``) spread tokens over the experts as trained, load-balanced routers
  do: per layer, the rows are orthogonal and of equal norm (QR of a normal matrix), so for a varied
  token sequence no expert is favoured and the router logits have a standard deviation of about
  :attr:`FullModelSpec.router_logit_std`. With :attr:`FullModelSpec.hot_experts` set (the *skewed*
  variant, :data:`SKEWED_SPEC`), every token embedding also carries one shared direction (real
  models' hidden states have such a mean component), the cold experts' rows are orthogonal to it and
  each layer's hot experts' rows lean on it, which lifts their logits by about
  :attr:`FullModelSpec.hot_logit` standard deviations of the (unlifted) logits: a few hot experts
  then take most of the picks (8 hot experts of 128, top-8, ``hot_logit`` 2.0: measured on the
  8-layer file over 48 varied tokens, 71% of the picks in the first layer, 66-87 distinct experts
  per layer against 113-123 of the spread file; the lift fades with depth).
- every matrix is drawn from that pool with a standard deviation of ``1 / sqrt(ne0)``, so a
  product keeps the size of its RMS-normalised input; the two projections that add to the residual
  stream (``attn_output``, ``ffn_down_exps``) are scaled by a further ``1 / sqrt(2 * n_layer)`` so
  the residual stays of order one through any number of layers, and the head gives logits of
  standard deviation about :attr:`FullModelSpec.logit_std`.
- the vocabulary is a small byte-level BPE (``tokenizer.ggml.model = gpt2``, ``pre = qwen2``): the
  256 byte tokens, the merges ``tokenizers``' BPE trainer learns from a short built-in English text
  (and its upper-case copy)
  (split with the Qwen2 pre-tokenizer pattern), then ``<|endoftext|>``, ``<|im_start|>``,
  ``<|im_end|>`` as control tokens (``token_type`` 3); EOS is ``<|im_end|>``, and a ChatML
  ``tokenizer.chat_template`` is included.

:func:`~aioexperts.testing.builtin_model_path` (and ``ensure_full_model`` of
:mod:`aioexperts.testing._builtin`) writes it once into the user cache, with the build lock of
:mod:`aioexperts.testing._cache`. Training the vocabulary needs ``tokenizers``
(``pip install 'aioexperts[text]'``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import gguf.quants
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType

from .._errors import ConfigError
from ._blocks import draw_blocks
from ._cache import check_free_space

#: Dense types whose embedding can take the skewed variant's shared direction (quantized again).
_REQUANTIZABLE = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0})

__all__ = (
    "CHATML_TEMPLATE",
    "DEFAULT_FULL_LAYERS",
    "FULL_SPEC",
    "SKEWED_SPEC",
    "FullModelSpec",
    "Progress",
    "train_vocabulary",
    "write_full_model",
)

Q = GGMLQuantizationType
#: ``(bytes written so far, total bytes)``.
Progress = Callable[[int, int], None]

#: Layers of the default built-in full model (about 3 GB).
DEFAULT_FULL_LAYERS = 8

#: ChatML, as Qwen's models use it (without their default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 split pattern (src/llama-vocab.cpp)
_QWEN2_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_TRAINING_TEXT = """\
The lighthouse keeper climbed the narrow stairs every evening before the sun went down. He carried a
small lamp, a notebook and a flask of tea, and he counted the steps as he went: one hundred and
twelve, never more and never fewer. At the top he cleaned the great lens, trimmed the wick and
wrote the weather in his book. "Wind from the west, light rain, three ships in the bay," he wrote.
Some nights the sea was calm and the stars were bright; other nights the storm beat against the
glass and the whole tower seemed to shake. He did not mind. The light had to burn, and it did.

In the village below, the baker rose at four to light her ovens. She made bread, rolls and a dark
cake with honey and nuts that the fishermen liked to take on their boats. Children stopped at her
window on the way to school, and she gave each of them a warm roll if they could tell her one new
thing they had learned. "The moon pulls the tides," said a boy. "Seven times eight is fifty-six,"
said a girl. "Bees dance to show where the flowers are," said another, and she gave him two.

A river runs through the valley and into the sea. In spring it is wide and fast, full of melted
snow from the mountains; in late summer it is slow and clear, and you can see the stones and the
small fish on the bottom. Farmers use its water for their fields of wheat, barley and potatoes.
An old stone bridge crosses it near the mill, and people say it was built more than three hundred
years ago by a man who wanted to marry a girl from the other side.

Computers follow instructions written by people. A program is a list of steps: read a number, add
it to another, store the result, compare it with a limit, and repeat until the work is done. Good
programs are clear and careful; they check their input, handle errors and explain what went wrong.
Memory holds the data a program works on, and a disk keeps it when the power is off. Reading from
a fast disk takes microseconds, while reading from memory takes nanoseconds, so a careful program
reads only what it needs and keeps the most useful parts close at hand.

Language models read text as tokens, small pieces of words. They learn which token is likely to
come next, and they write by choosing one token at a time. A model with many experts sends each
token to only a few of them, so it can be large and still fast. This little model has random
weights: it has learned nothing, and the words it writes are random. It exists so that you can
try every part of the program, from the tokenizer to the chat template and the sampler, without
downloading a real model first.

Questions and answers: What time is it? It is half past seven. Where are you going? I am going
to the market to buy apples, cheese, eggs and milk. How much does it cost? Twelve dollars and
fifty cents. Thank you very much! You are welcome. Please tell me a story about a cat, a dog and
a mouse who became friends. Once upon a time, in a house at the end of a long road, there lived a
cat named Pepper, a dog named Max and a very small, very brave mouse named Tilly.

Weather and seasons: January brings frost, February brings snow, March brings wind and April
brings showers. By June the meadows are green and yellow, bright with buttercups, daisies and
clover; in August the heat settles over the orchards, and plums, pears and peaches ripen quickly.
October is golden and smoky, November grey and damp, and December dark, quiet and cold.

Cooking notes: chop two onions finely, soften them in butter, then add garlic, thyme, rosemary
and a pinch of pepper. Stir in chopped tomatoes, simmer gently for twenty minutes, season with
salt, and finish with fresh basil and grated parmesan. Serve with pasta, rice, roasted vegetables
or crusty bread. Leftovers keep overnight in the refrigerator and freeze well for several weeks.

Travel diary: we left the harbour at dawn, sailing north along the rocky coastline past cliffs,
caves and sheltered beaches. Seabirds wheeled overhead: gulls, terns, cormorants and puffins. At
noon we anchored near an island where wild goats grazed among ruined cottages, and in the evening
we reached a busy port with colourful houses, crowded restaurants, museums and a cathedral.

Science corner: water boils at one hundred degrees Celsius at sea level, but at lower temperatures
on high mountains, because the air pressure is lower there. Light travels about three hundred
thousand kilometres per second. Plants turn sunlight, carbon dioxide and water into sugar and
oxygen; animals breathe that oxygen and release carbon dioxide. Electricity flows through copper
wires, magnets attract iron, and gravity keeps the planets moving in orbit around the sun.

History lesson: ancient empires rose and fell along great rivers. Merchants traded silk, spices,
salt, gold, silver, timber and wool; scholars copied manuscripts, studied mathematics, astronomy,
medicine and philosophy; engineers built roads, aqueducts, harbours, temples and fortresses.
Printing presses spread books widely, railways connected distant cities, and telegraphs carried
messages across oceans within minutes instead of months.

Office email: Dear colleagues, the quarterly meeting is rescheduled to Thursday afternoon at three
o'clock in conference room B. Please review the attached budget, prepare short updates on your
projects, and send questions beforehand. Coffee, sandwiches and biscuits will be provided. Kind
regards, Margaret. P.S. Remember to submit expense reports before Friday; late reports delay payment.

Sports report: the home team scored twice in the final quarter, winning a thrilling match before a
record crowd. Their goalkeeper made several remarkable saves, the captain organised the defence
calmly, and the young striker celebrated her first professional goal. Supporters sang, cheered and
waved flags long after the referee blew the whistle.

Programming tutorial: define a function that takes a list of integers and returns the largest
value. Initialise a variable with the first element, loop over the remaining elements, update the
variable whenever a bigger element appears, and finally return it. Write tests for empty lists,
negative numbers, duplicates and very long inputs; measure performance, refactor carefully, and
document every parameter, exception and return value. Use version control, review changes, and
deploy only after continuous integration passes.
"""


@dataclass(frozen=True)
class FullModelSpec:
    """Geometry and types of the built-in full model (default: Qwen3-30B-A3B, 8 layers).

    Attributes:
        n_layer: transformer blocks (every one attention + MoE).
        n_embd: hidden size.
        n_head, n_head_kv, head_dim: attention heads, KV heads (GQA) and head size.
        n_expert, n_expert_used, n_ff_exp: experts per layer, top-k and expert FFN width.
        context_length: ``qwen3moe.context_length``.
        rope_freq_base: ``qwen3moe.rope.freq_base`` (qwen3moe uses NEOX RoPE).
        rms_eps: ``qwen3moe.attention.layer_norm_rms_epsilon``.
        vocab_size: the most ids of the trained vocabulary, control tokens included.
        dense_type: ggml type of the attention matrices, the token embedding and the head.
        expert_type: ggml type of the routed experts.
        logit_std: standard deviation of the logits the head gives for an RMS-normalised state.
        router_logit_std: standard deviation of the router logits for an RMS-normalised state.
        hot_experts: experts per layer that the router favours (0: none, the spread routing).
        hot_logit: how far the hot experts' logits are lifted, in router-logit standard deviations
            (at the first layer; it fades a little in deeper ones as the residual stream grows).
        seed: seed of the weights.
    """

    n_layer: int = DEFAULT_FULL_LAYERS
    n_embd: int = 2048
    n_head: int = 32
    n_head_kv: int = 4
    head_dim: int = 128
    n_expert: int = 128
    n_expert_used: int = 8
    n_ff_exp: int = 768
    context_length: int = 40960
    rope_freq_base: float = 1e6
    rms_eps: float = 1e-6
    vocab_size: int = 4096
    dense_type: GGMLQuantizationType = Q.Q8_0
    expert_type: GGMLQuantizationType = Q.Q4_K
    logit_std: float = 3.0
    router_logit_std: float = 1.0
    hot_experts: int = 0
    hot_logit: float = 2.0
    seed: int = 0

    def with_(self, **changes: object) -> FullModelSpec:
        """A copy with some fields changed."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def check(self) -> None:
        """Raises ConfigError for an inconsistent spec (the message names the field)."""
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_expert", "n_expert_used", "n_ff_exp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"FullModelSpec.{name} must be a positive int, got {value!r}")
        if self.n_head % self.n_head_kv:
            raise ConfigError(f"FullModelSpec.n_head={self.n_head} is not a multiple of n_head_kv={self.n_head_kv}")
        if self.n_expert_used > self.n_expert:
            raise ConfigError(f"FullModelSpec.n_expert_used={self.n_expert_used} > n_expert={self.n_expert}")
        if isinstance(self.hot_experts, bool) or not isinstance(self.hot_experts, int):
            raise ConfigError(f"FullModelSpec.hot_experts must be an int, got {self.hot_experts!r}")
        if not 0 <= self.hot_experts < self.n_expert:
            raise ConfigError(f"FullModelSpec.hot_experts={self.hot_experts} is outside [0, n_expert={self.n_expert})")
        if self.n_expert + 1 > self.n_embd:
            raise ConfigError(
                f"FullModelSpec.n_expert={self.n_expert} needs n_embd > n_expert for orthogonal router rows, "
                f"got n_embd={self.n_embd}"
            )
        for name in ("router_logit_std", "hot_logit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e3:
                raise ConfigError(f"FullModelSpec.{name} must be a number in [0, 1000), got {value!r}")
        if self.hot_experts and self.dense_type not in _REQUANTIZABLE:
            raise ConfigError(
                "FullModelSpec.hot_experts needs a dense_type gguf-py can quantize "
                f"({', '.join(sorted(t.name for t in _REQUANTIZABLE))}), "
                f"got {self.dense_type.name}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"FullModelSpec.head_dim={self.head_dim} must be even (RoPE)")
        if not 256 + len(CONTROL_TOKENS) < self.vocab_size <= 1 << 20:
            raise ConfigError(
                f"FullModelSpec.vocab_size={self.vocab_size} is outside ({256 + len(CONTROL_TOKENS)}, 2**20]"
            )
        for name, ggml_type, ne0 in (
            ("dense_type", self.dense_type, self.n_embd),
            ("dense_type", self.dense_type, self.n_head * self.head_dim),
            ("expert_type", self.expert_type, self.n_embd),
            ("expert_type", self.expert_type, self.n_ff_exp),
        ):
            block = GGML_QUANT_SIZES[ggml_type][0]
            if ne0 % block:
                raise ConfigError(
                    f"FullModelSpec.{name}={ggml_type.name} needs rows of a multiple of {block}, got {ne0}"
                )
            if draw_blocks(np.random.default_rng(0), ggml_type, 1, 1.0) is None:
                raise ConfigError(f"FullModelSpec.{name}={ggml_type.name}: no block pool for this type")

    def tensor_bytes(self) -> int:
        """The bytes of the file's tensors (at most: the vocabulary counted as ``vocab_size`` ids)."""

        def total(n_layer: int) -> int:
            tensors = _tensors(self.with_(n_layer=n_layer), self.vocab_size, np.random.default_rng(0))
            return sum(_tensor_bytes(t, shape) for _, shape, t, _make in tensors)

        one = total(1)  # every block is the same: one, then the others (100000 layers in no time)
        return one + (self.n_layer - 1) * (total(2) - one)

    def file_name(self) -> str:
        """The cache file name; it changes with the geometry and with the generator's version."""
        if self == FULL_SPEC.with_(n_layer=self.n_layer):
            dims = ""
        elif self == SKEWED_SPEC.with_(n_layer=self.n_layer):
            dims = f"-hot{self.hot_experts}"
        else:
            fields = {k: (v.name if isinstance(v, GGMLQuantizationType) else v) for k, v in vars(self).items()}
            key = json.dumps(fields, sort_keys=True, allow_nan=False).encode()
            dims = "-custom" + hashlib.sha256(key).hexdigest()[:10]
        t = f"{self.dense_type.name.lower()}-{self.expert_type.name.lower()}"
        return f"qwen3-30b-a3b-geometry-full-{t}-{self.n_layer}l{dims}-v2.gguf"


#: The default built-in full model (routing spread over the experts).
FULL_SPEC = FullModelSpec()

#: The skewed variant: 8 hot experts per layer take about half of the router's picks.
SKEWED_SPEC = FULL_SPEC.with_(hot_experts=8)


def train_vocabulary(vocab_size: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary learned from the built-in text.

    Returns:
        ``(tokens, merges)``: tokens in GGUF byte-level form (the 256 byte tokens first, then the
        merges' results, then :data:`CONTROL_TOKENS`), merges as ``"left right"``.

    Raises:
        ConfigError: ``tokenizers`` is not installed.
    """
    try:
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    except ImportError:
        raise ConfigError(
            "the built-in full model's vocabulary needs tokenizers: pip install 'aioexperts[text]'"
        ) from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(CONTROL_TOKENS),
        min_frequency=1,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    # the text and its upper-case copy: about twice the merges from the same words
    tokenizer.train_from_iterator([_TRAINING_TEXT, _TRAINING_TEXT.upper()], trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    if sorted(tokens[:256]) != alphabet:
        raise AssertionError("the trainer did not put the 256 byte tokens first")
    return [*tokens, *CONTROL_TOKENS], merges


def _blocks(
    rng: np.random.Generator, ggml_type: GGMLQuantizationType, shape: tuple[int, ...], std: float
) -> np.ndarray:
    """Quantized data of numpy ``shape`` (last axis = ne0) as uint8 ``(*shape[:-1], row_bytes)``."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_blocks = int(np.prod(shape)) // block_size
    drawn = draw_blocks(rng, ggml_type, n_blocks, std)
    assert drawn is not None  # checked by FullModelSpec.check
    return drawn.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def _n_bytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return int(np.prod(shape)) // block_size * type_size


_Tensor = tuple[str, tuple[int, ...], GGMLQuantizationType, Callable[[], np.ndarray]]


def _tensors(spec: FullModelSpec, n_vocab: int, rng: np.random.Generator) -> list[_Tensor]:
    """``(name, numpy shape, type, make_data)`` in file order (llama.cpp's qwen3moe tensors)."""
    e, hd, f = spec.n_embd, spec.head_dim, spec.n_ff_exp
    q_dim, kv_dim = spec.n_head * hd, spec.n_head_kv * hd
    residual = (2 * spec.n_layer) ** -0.5
    dense, experts = spec.dense_type, spec.expert_type

    def ones(n: int) -> Callable[[], np.ndarray]:
        return lambda: (1.0 + 0.02 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    def matrix(t: GGMLQuantizationType, shape: tuple[int, ...], std: float) -> Callable[[], np.ndarray]:
        return lambda: _blocks(rng, t, shape, std)

    shared = rng.standard_normal(e).astype(np.float32)  # the skewed variant's common direction (unit RMS)
    embedding = matrix(dense, (n_vocab, e), 1.0)
    if spec.hot_experts:
        embedding = _with_shared_direction(embedding, dense, (n_vocab, e), shared)
    out: list[_Tensor] = [("token_embd.weight", (n_vocab, e), dense, embedding)]
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (e,), Q.F32, ones(e)),
            (b + "attn_q.weight", (q_dim, e), dense, matrix(dense, (q_dim, e), e**-0.5)),
            (b + "attn_k.weight", (kv_dim, e), dense, matrix(dense, (kv_dim, e), e**-0.5)),
            (b + "attn_v.weight", (kv_dim, e), dense, matrix(dense, (kv_dim, e), e**-0.5)),
            (b + "attn_q_norm.weight", (hd,), Q.F32, ones(hd)),
            (b + "attn_k_norm.weight", (hd,), Q.F32, ones(hd)),
            (b + "attn_output.weight", (e, q_dim), dense, matrix(dense, (e, q_dim), q_dim**-0.5 * residual)),
            (b + "ffn_norm.weight", (e,), Q.F32, ones(e)),
            (
                b + "ffn_gate_inp.weight",
                (spec.n_expert, e),
                Q.F32,
                (lambda: _router(rng, spec, shared)),
            ),
            (
                b + "ffn_gate_exps.weight",
                (spec.n_expert, f, e),
                experts,
                matrix(experts, (spec.n_expert, f, e), e**-0.5),
            ),
            (b + "ffn_up_exps.weight", (spec.n_expert, f, e), experts, matrix(experts, (spec.n_expert, f, e), e**-0.5)),
            (
                b + "ffn_down_exps.weight",
                (spec.n_expert, e, f),
                experts,
                matrix(experts, (spec.n_expert, e, f), f**-0.5 * residual),
            ),
        ]
    out += [
        ("output_norm.weight", (e,), Q.F32, ones(e)),
        ("output.weight", (n_vocab, e), dense, matrix(dense, (n_vocab, e), spec.logit_std * e**-0.5)),
    ]
    return out


def _router(rng: np.random.Generator, spec: FullModelSpec, shared: np.ndarray) -> np.ndarray:
    """One layer's router, float32 ``(n_expert, n_embd)``: orthogonal rows of equal norm.

    For an RMS-normalised state ``x`` (``|x| = sqrt(n_embd)``) of isotropic direction, each logit
    ``row . x`` then has standard deviation ``router_logit_std`` and no expert is favoured. Every row
    is orthogonal to ``shared``; the hot experts' rows (skewed variant) add ``shared`` so that a state
    whose direction is half ``shared`` (the first layer's: embedding row plus ``shared``, both of
    unit RMS) lifts their logits by ``hot_logit`` standard deviations.
    """
    e, n = spec.n_embd, spec.n_expert
    basis = np.column_stack([shared.astype(np.float64), rng.standard_normal((e, n))])
    q, _ = np.linalg.qr(basis)  # q[:, 0] is +-shared's direction, q[:, 1:] orthonormal and orthogonal to it
    q[:, 0] *= np.sign(q[:, 0] @ shared)  # QR may flip it
    rows = q[:, 1:].T * spec.router_logit_std  # (n, e), unit rows: logit std = router_logit_std
    if spec.hot_experts:
        hot = rng.choice(n, size=spec.hot_experts, replace=False)
        # state x = sqrt(e) * (cos 45deg * q0 + ...): q0 . x = sqrt(e / 2)
        rows[hot] += q[:, 0] * (spec.hot_logit * spec.router_logit_std / np.sqrt(e / 2))
    return np.ascontiguousarray(rows, dtype=np.float32)


def _with_shared_direction(
    make: Callable[[], np.ndarray], ggml_type: GGMLQuantizationType, shape: tuple[int, ...], shared: np.ndarray
) -> Callable[[], np.ndarray]:
    """``make``'s quantized rows with ``shared`` added to every row (quantized again)."""

    def build() -> np.ndarray:
        rows = gguf.quants.dequantize(make(), ggml_type).reshape(shape) + shared
        return gguf.quants.quantize(rows.astype(np.float32), ggml_type)

    return build


def _tensor_bytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    return 4 * int(np.prod(shape)) if ggml_type == Q.F32 else _n_bytes(ggml_type, shape)


def write_full_model(
    path: str | os.PathLike[str], spec: FullModelSpec = FULL_SPEC, *, progress: Progress | None = None
) -> Path:
    """Write the full model of ``spec`` (see the module docstring) to ``path``.

    Args:
        path: the GGUF file to write.
        spec: the geometry (tests pass a small one).
        progress: ``(bytes written, total bytes)`` after each tensor.

    Returns:
        ``path``.

    Raises:
        ConfigError: an inconsistent spec, or ``tokenizers`` is missing.
        OSError: the file cannot be written.
    """
    spec.check()
    tokens, merges = train_vocabulary(spec.vocab_size)
    n_vocab = len(tokens)
    rng = np.random.default_rng(spec.seed)
    tensors = _tensors(spec, n_vocab, rng)

    writer = GGUFWriter(os.fspath(path), "qwen3moe")
    writer.add_name("aioexperts built-in full model (random weights)")
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff_exp * spec.n_expert_used)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_freq_base)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_expert_count(spec.n_expert)
    writer.add_expert_used_count(spec.n_expert_used)
    writer.add_expert_feed_forward_length(spec.n_ff_exp)
    add_vocabulary(writer, tokens, merges, pad=True)
    write_tensors(writer, tensors, [_tensor_bytes(t, shape) for _, shape, t, _ in tensors], progress)
    return Path(path)


def add_vocabulary(writer: GGUFWriter, tokens: list[str], merges: list[str], *, pad: bool) -> None:
    """The built-in models' byte-level BPE vocabulary, its special ids and the ChatML template
    (``pad``: ``<|endoftext|>`` is the padding id too)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in CONTROL_TOKENS else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    if pad:
        writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def _check_free_space(writer: GGUFWriter, n_bytes: int) -> None:
    """:func:`check_free_space` of the folder ``writer`` writes into (nothing for a writer without a path).

    Raises:
        OSError: ``ENOSPC``, saying how much is needed and free.
    """
    path = getattr(writer, "path", None)
    if path is not None:
        check_free_space(Path(path).parent, n_bytes)


def write_tensors(
    writer: GGUFWriter,
    tensors: Sequence[tuple[str, tuple[int, ...], GGMLQuantizationType, Callable[[], np.ndarray]]],
    sizes: Sequence[int],
    progress: Progress | None,
) -> None:
    """Announce ``(name, shape, type, make)`` with their byte ``sizes``, write the header, then each
    tensor's ``make()`` in order (``progress(bytes written, total)`` after each); closes the writer.

    Raises:
        AssertionError: a tensor made other than the bytes announced.
        OSError: the file cannot be written.
    """
    for (name, shape, ggml_type, _make), n_bytes in zip(tensors, sizes, strict=True):
        dtype = np.dtype(np.int32) if ggml_type == Q.I32 else np.dtype(np.float32)
        writer.add_tensor_info(name, shape, dtype, n_bytes, raw_dtype=ggml_type)
    total, written = sum(sizes), 0
    try:
        _check_free_space(writer, total)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for (name, _shape, _type, make), n_bytes in zip(tensors, sizes, strict=True):
            data = make()
            if data.nbytes != n_bytes:
                raise AssertionError(f"{name}: {data.nbytes} bytes made, {n_bytes} announced")
            writer.write_tensor_data(data)
            written += n_bytes
            if progress is not None:
                progress(written, total)
    finally:
        writer.close()
