"""The fuzz harness's doors and input generators, shared by the tests (``tests/fuzz/test_*.py``) and
the long run (``tests/fuzz/run_long.py``; docs/fuzzing.md).

A *door* takes one input that came from outside (bytes of a GGUF file, a text, a chat, a request
body), runs the library on it and checks the contract: only the documented exception types come out
(:class:`aioexperts.AioExpertsError` subclasses; for the server an OpenAI-style 4xx error object), and
what is accepted is sane (in bounds, round trips). A broken contract raises :class:`Unexpected`
carrying the offending exception. Generators take a :class:`random.Random` and give one input: the
long run draws from a seeded ``Random``, the tests from hypothesis's ``st.randoms()`` (so hypothesis
shrinks a failure) beside hypothesis's own strategies.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

_TESTS = Path(__file__).resolve().parents[1]
if str(_TESTS) not in sys.path:  # gguf_bytes.py; pytest puts tests/ there, the long run does not
    sys.path.insert(0, str(_TESTS))

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFValueType as T  # noqa: E402
from gguf_bytes import Arr, GGUFBytes, Tensor, kv, string  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from aioexperts import AioExpertsError, ChatTemplate, Tokenizer  # noqa: E402
from aioexperts._format.hparams import MoEHParams  # noqa: E402
from aioexperts._format.layout import build_layout  # noqa: E402
from aioexperts._format.model import GGUFModel, open_model  # noqa: E402
from aioexperts._json import dumps as strict_dumps  # noqa: E402
from aioexperts.serve._errors import APIError  # noqa: E402
from aioexperts.serve._validate import parse_chat, parse_completion, parse_json  # noqa: E402

REPO = _TESTS.parent

#: the tests' budget: examples per test, and a deadline per example (a slow input is a hang)
FUZZ = settings(
    max_examples=150,
    deadline=timedelta(seconds=3),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


def shared_vocab_paths() -> list[Path]:
    """llama.cpp's vocabulary files: ``$AIOEXPERTS_VOCAB``, else ``../shared/vocab`` beside the checkout."""
    env = os.environ.get("AIOEXPERTS_VOCAB")
    for cand in [*([Path(env)] if env else []), REPO.parent / "shared" / "vocab"]:
        found = sorted(cand.glob("*.gguf")) if cand.is_dir() else []
        if found:
            return found
    return []


class Hang(BaseException):  # noqa: N818
    """Raised by the long run's per-input alarm; passes through every door untouched."""


#: what a door lets through unchanged
PASS = (KeyboardInterrupt, SystemExit)


class Unexpected(Exception):  # noqa: N818 (it is what the harness reports)
    """The contract is broken: ``cause`` is the exception that came out (or an AssertionError)."""

    def __init__(self, door: str, cause: BaseException) -> None:
        super().__init__(f"{door}: {type(cause).__name__}: {cause}")
        self.door = door
        self.cause = cause


# ================================================================================================
# helpers


INTERESTING_U64 = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    31,
    32,
    33,
    255,
    4096,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1 << 40,
    1 << 62,
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 32,
    (1 << 64) - 1,
]
INTERESTING_U32 = [v for v in INTERESTING_U64 if v < 1 << 32] + [13, 14, 9, 12, 30, 31, 39, 40, 41, 0xFFFF0000]


def _pick(rnd: random.Random, items: Sequence[Any]) -> Any:
    return items[rnd.randrange(len(items))]


# ================================================================================================
# door (a): the GGUF header and tensor table reader


def _moe_tensors(layer: int, n_embd: int, n_ff: int, banks: Sequence[tuple[int, Q]]) -> list[Tensor]:
    total = sum(n for n, _ in banks)
    out = [Tensor(f"blk.{layer}.ffn_gate_inp.weight", [n_embd, total])]
    for tier, (n, t) in enumerate(banks):
        sfx = f"_tier{tier}" if tier else ""
        out.append(Tensor(f"blk.{layer}.ffn_gate_exps{sfx}.weight", [n_embd, n_ff, n], t))
        out.append(Tensor(f"blk.{layer}.ffn_up_exps{sfx}.weight", [n_embd, n_ff, n], t))
        out.append(Tensor(f"blk.{layer}.ffn_down_exps{sfx}.weight", [n_ff, n_embd, n], t))
    return out


def _moe_seed(arch: str = "qwen3moe", *, alignment: int | None = None, tiers: bool = False) -> bytes:
    g = GGUFBytes(alignment=alignment or 32)
    g.add("general.architecture", T.STRING, arch)
    if alignment is not None:
        g.add("general.alignment", T.UINT32, alignment)
    for key, value in (("block_count", 2), ("embedding_length", 32), ("expert_count", 4), ("expert_used_count", 2)):
        g.add(f"{arch}.{key}", T.UINT32, value)
    g.add(f"{arch}.expert_feed_forward_length", T.UINT32, 32)
    g.add(f"{arch}.rope.freq_base", T.FLOAT32, 10000.0)
    g.add("general.name", T.STRING, "fuzz seed \u00e9")
    g.add("test.flags", T.ARRAY, Arr(T.BOOL, [True, False, True]))
    g.add("test.nested", T.ARRAY, Arr(T.ARRAY, [Arr(T.INT32, [1, 2]), Arr(T.STRING, ["a", "bc"])]))
    g.add("tokenizer.ggml.tokens", T.ARRAY, Arr(T.STRING, ["<s>", "</s>", "a", "bc", "\u00e9"]))
    g.add("tokenizer.ggml.token_type", T.ARRAY, Arr(T.INT32, [3, 3, 1, 1, 1]))
    g.add("tokenizer.ggml.bos_token_id", T.UINT32, 0)
    g.add("tokenizer.chat_template", T.STRING, "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}")
    banks = ((2, Q.F32), (1, Q.F16), (1, Q.Q8_0)) if tiers else ((4, Q.F16),)
    g.tensors = _moe_tensors(0, 32, 32, banks) + _moe_tensors(1, 32, 32, ((4, Q.Q8_0),))
    g.tensors.append(Tensor("output_norm.weight", [32]))
    return g.build()


def _vocab_seed(model: str = "gpt2", *, extra: int = 0) -> bytes:
    """A vocabulary-only GGUF (no tensors): a tiny byte-level BPE or SentencePiece vocabulary, with
    ``extra`` more tokens (over ``MAX_DECODED_ITEMS`` its arrays stay in the file for the header reader
    and are read by the vocabulary reader)."""
    g = GGUFBytes()
    g.add("general.architecture", T.STRING, "llama")
    filler = [f"x{i}" for i in range(extra)]
    if model == "gpt2":
        keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        chars = {b: chr(b) for b in keep}
        for n, b in enumerate(b for b in range(256) if b not in chars):
            chars[b] = chr(256 + n)
        tokens = [chars[b] for b in range(256)] + ["Ġt", "he", "Ġthe", *filler, "<|endoftext|>", "<tool>"]
        merges = ["Ġ t", "h e", "Ġt he"] + [f"x{i} {i % 10}" for i in range(10, extra)]
        g.add("tokenizer.ggml.model", T.STRING, "gpt2")
        g.add("tokenizer.ggml.pre", T.STRING, "gpt-2" if not extra else "qwen2")
        g.add("tokenizer.ggml.tokens", T.ARRAY, Arr(T.STRING, tokens))
        g.add("tokenizer.ggml.token_type", T.ARRAY, Arr(T.INT32, [1] * (len(tokens) - 2) + [3, 4]))
        g.add("tokenizer.ggml.merges", T.ARRAY, Arr(T.STRING, merges))
        g.add("tokenizer.ggml.bos_token_id", T.UINT32, len(tokens) - 2)
        g.add("tokenizer.ggml.eos_token_id", T.UINT32, len(tokens) - 2)
    else:
        pieces = ["▁", "a", "b", "▁a", "ab", *filler]
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
        scores = [0.0] * 259 + [-1.0, -2.0, -2.0, -0.5, -3.0] + [-4.0 - i for i in range(extra)]
        g.add("tokenizer.ggml.model", T.STRING, "llama")
        g.add("tokenizer.ggml.tokens", T.ARRAY, Arr(T.STRING, tokens))
        g.add("tokenizer.ggml.scores", T.ARRAY, Arr(T.FLOAT32, scores))
        g.add("tokenizer.ggml.token_type", T.ARRAY, Arr(T.INT32, [2, 3, 3] + [6] * 256 + [1] * len(pieces)))
        g.add("tokenizer.ggml.bos_token_id", T.UINT32, 1)
        g.add("tokenizer.ggml.eos_token_id", T.UINT32, 2)
    g.add("tokenizer.chat_template", T.STRING, "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    return g.build()


@dataclass(frozen=True)
class Seed:
    name: str
    data: bytes
    header_len: int  # bytes before the tensor data (mutations aim here)


def _header_len(data: bytes) -> int:
    """Where the data section starts (the end of the tensor infos, aligned), by reading the seed."""
    from aioexperts._format.header import _Cursor, _parse

    path = f"/dev/shm/aioexperts-fuzz-seed-{os.getpid()}.gguf"
    with open(path, "wb") as f:
        f.write(data)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return min(len(data), _parse(_Cursor(fd, len(data), path), path).data_start)
        finally:
            os.close(fd)
    finally:
        os.unlink(path)


_SEEDS: list[Seed] | None = None


def seeds() -> list[Seed]:
    """Valid small GGUF files: MoE models (one bank; mixed tiers; alignment 64) and two vocabularies."""
    global _SEEDS
    if _SEEDS is None:
        raw = [
            ("moe", _moe_seed()),
            ("moe-tiers", _moe_seed(tiers=True)),
            ("moe-align64", _moe_seed("deepseek2", alignment=64)),
            ("vocab-bpe", _vocab_seed("gpt2")),
            ("vocab-spm", _vocab_seed("llama")),
            ("vocab-bpe-large", _vocab_seed("gpt2", extra=4200)),
            ("vocab-spm-large", _vocab_seed("llama", extra=4200)),
        ]
        _SEEDS = [Seed(name, data, _header_len(data)) for name, data in raw]
    return _SEEDS


def mutate(rnd: random.Random, seed: Seed) -> bytes:
    """One mutated copy of ``seed``: 1..8 of bit flips, byte sets, interesting u32/u64 values (aligned
    or not), inserted or deleted runs, a duplicated run, then maybe a truncation."""
    data = bytearray(seed.data)
    region = max(1, min(len(data), seed.header_len + 64))
    for _ in range(rnd.choice((1, 1, 1, 2, 2, 3, rnd.randint(1, 8)))):
        kind = rnd.randrange(8)
        pos = rnd.randrange(region) if rnd.random() < 0.9 else rnd.randrange(len(data) or 1)
        if kind == 0 and data:
            data[min(pos, len(data) - 1)] ^= 1 << rnd.randrange(8)
        elif kind == 1 and data:
            data[min(pos, len(data) - 1)] = _pick(rnd, (0, 1, 0x7F, 0x80, 0xFF, rnd.randrange(256)))
        elif kind in (2, 3):
            width, values = (8, INTERESTING_U64) if kind == 2 else (4, INTERESTING_U32)
            if rnd.random() < 0.6:
                pos -= pos % 4
            value = _pick(rnd, values)
            if rnd.random() < 0.2:
                value = max(0, min((1 << (8 * width)) - 1, value + rnd.choice((-1, 1))))
            if pos + width <= len(data):
                data[pos : pos + width] = value.to_bytes(width, "little")
        elif kind == 4:
            n = rnd.choice((1, 2, 4, 8, rnd.randrange(1, 64)))
            data[pos:pos] = bytes(rnd.randrange(256) for _ in range(n))
        elif kind == 5:
            del data[pos : pos + rnd.choice((1, 4, 8, rnd.randrange(1, 64)))]
        elif kind == 6 and data:
            a = rnd.randrange(len(data))
            run = data[a : a + rnd.randrange(1, 128)]
            data[pos:pos] = run
        elif kind == 7:  # a type tag
            if pos + 4 <= len(data):
                data[pos : pos + 4] = rnd.randrange(0, 40).to_bytes(4, "little")
    if rnd.random() < 0.25:
        cut = rnd.randrange(len(data) + 1) if rnd.random() < 0.3 else rnd.randrange(min(len(data), region) + 1)
        del data[cut:]
    return bytes(data)


def _random_value(rnd: random.Random, depth: int = 0) -> tuple[T, Any]:
    """A random metadata value (type, payload for gguf_bytes.kv), sometimes with a lying count."""
    vtype = _pick(rnd, list(T))
    if vtype == T.STRING:
        return vtype, bytes(rnd.randrange(256) for _ in range(rnd.randrange(12)))
    if vtype == T.ARRAY:
        item = _pick(rnd, list(T)) if depth < 3 else T.UINT8
        items: list[Any]
        n = rnd.randrange(6)
        if item == T.ARRAY:
            inner = _pick(rnd, [t for t in T if t != T.ARRAY])
            items = [Arr(inner, [_scalar_or_str(rnd, inner) for _ in range(rnd.randrange(3))]) for _ in range(n)]
        else:
            items = [_scalar_or_str(rnd, item) for _ in range(n)]
        count = None if rnd.random() < 0.6 else _pick(rnd, INTERESTING_U64)
        return vtype, Arr(item, items, count)
    return vtype, _scalar_or_str(rnd, vtype)


def _scalar_or_str(rnd: random.Random, vtype: T) -> Any:
    if vtype == T.STRING:
        return "".join(chr(rnd.randrange(32, 0x250)) for _ in range(rnd.randrange(6)))
    if vtype in (T.FLOAT32, T.FLOAT64):
        return _pick(rnd, (0.0, -1.5, 1e30, float("inf"), float("nan"), rnd.uniform(-1e6, 1e6)))
    if vtype == T.BOOL:
        return rnd.random() < 0.5
    bits = {T.UINT8: 8, T.INT8: 8, T.UINT16: 16, T.INT16: 16, T.UINT32: 32, T.INT32: 32, T.UINT64: 64, T.INT64: 64}
    b = bits.get(vtype, 8)
    signed = vtype in (T.INT8, T.INT16, T.INT32, T.INT64)
    lo, hi = (-(1 << (b - 1)), (1 << (b - 1)) - 1) if signed else (0, (1 << b) - 1)
    return _pick(rnd, (lo, hi, 0, 1, rnd.randint(lo, hi)))


_KEYS = [
    "general.architecture",
    "general.alignment",
    "qwen3moe.expert_count",
    "qwen3moe.expert_used_count",
    "qwen3moe.embedding_length",
    "qwen3moe.block_count",
    "qwen3moe.expert_feed_forward_length",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.chat_template",
    "split.count",
    "split.no",
]


def structured(rnd: random.Random) -> bytes:
    """A GGUF built field by field with random keys, types and values, counts that lie, odd tensors."""
    g = GGUFBytes(version=_pick(rnd, (3, 3, 3, 2, 1, 4, 0x03000000)))
    if rnd.random() < 0.8:
        g.add("general.architecture", T.STRING, _pick(rnd, ("qwen3moe", "deepseek2", "llama", "", "x" * 40)))
    for _ in range(rnd.randrange(8)):
        key = _pick(rnd, _KEYS) if rnd.random() < 0.6 else "".join(chr(rnd.randrange(33, 127)) for _ in range(5))
        vtype, value = _random_value(rnd)
        if vtype == T.ARRAY and value.count is not None:
            g.kvs.append(string(key) + struct.pack("<I", int(vtype)) + value.payload())
        else:
            g.kvs.append(kv(key, vtype, value))
    blob = g.build()
    n_tensors = rnd.randrange(4)
    infos = b""
    for i in range(n_tensors):
        name = _pick(rnd, ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_inp.weight", f"t{i}", "", "\xff"))
        n_dims = _pick(rnd, (1, 2, 3, 4, 0, 5, 1 << 31))
        dim_values = (1, 32, 0, 1 << 32, (1 << 64) - 1)
        dims = b"".join(struct.pack("<Q", _pick(rnd, dim_values)) for _ in range(min(n_dims, 5)))
        infos += string(name.encode("utf-8", "surrogateescape")) + struct.pack("<I", n_dims) + dims
        infos += struct.pack("<IQ", _pick(rnd, (0, 1, 8, 12, 39, 1000)), _pick(rnd, (0, 32, 64, 1 << 63)))
    # patch the tensor count and append the infos and some data
    blob = blob[:8] + struct.pack("<Q", n_tensors if rnd.random() < 0.8 else _pick(rnd, INTERESTING_U64)) + blob[16:]
    if rnd.random() < 0.3:
        blob = blob[:16] + struct.pack("<Q", _pick(rnd, INTERESTING_U64)) + blob[24:]
    body = blob.rstrip(b"\0") if rnd.random() < 0.5 else blob
    return body + infos + bytes(-(len(body) + len(infos)) % 32) + bytes(rnd.randrange(0, 4096))


def random_bytes(rnd: random.Random) -> bytes:
    n = rnd.choice((0, 1, 3, 4, 8, 24, rnd.randrange(512), rnd.randrange(4096)))
    raw = rnd.randbytes(n)
    if rnd.random() < 0.5:
        raw = b"GGUF" + struct.pack("<I", _pick(rnd, (2, 3))) + raw
    return raw


def header_input(rnd: random.Random) -> bytes:
    """One input for door (a): mostly mutated seeds, then structured files, then random bytes."""
    r = rnd.random()
    if r < 0.7:  # the large vocabularies (a few ms each to build) one time in twenty
        all_seeds = seeds()
        small = [s for s in all_seeds if not s.name.endswith("-large")]
        return mutate(rnd, _pick(rnd, small if rnd.random() < 0.95 else all_seeds))
    if r < 0.9:
        return structured(rnd)
    return random_bytes(rnd)


def huge_count_input(rnd: random.Random) -> bytes:
    """A small file whose counts or lengths claim far more than it holds (for the memory bound)."""
    seed = _pick(rnd, seeds())
    data = bytearray(seed.data[: rnd.randrange(24, seed.header_len + 1)])
    where = rnd.choice(("tensors", "kvs", "field"))
    if where == "tensors":
        data[8:16] = _pick(rnd, INTERESTING_U64[10:]).to_bytes(8, "little")
    elif where == "kvs":
        data[16:24] = _pick(rnd, INTERESTING_U64[10:]).to_bytes(8, "little")
    else:
        pos = rnd.randrange(24, max(25, len(data) - 8))
        data[pos : pos + 8] = _pick(rnd, INTERESTING_U64[10:]).to_bytes(8, "little")
    return bytes(data[: max(24, len(data))])


def _check_model(model: GGUFModel) -> None:
    sizes = [s.size for s in model.shards]
    for info in model.tensors.values():
        assert 0 <= info.data_offset and info.data_offset + info.n_bytes <= sizes[info.shard], info
    try:
        layout = build_layout(model)
    except AioExpertsError:
        layout = None
    if layout is not None:
        for loc in layout:
            for seg in loc.segments:
                assert seg.n_bytes > 0 and 0 <= seg.offset and seg.end <= sizes[seg.shard], seg
    try:
        MoEHParams.from_metadata(model.architecture, model.metadata)
    except AioExpertsError:
        pass


_serial = itertools.count()


def header_door(data: bytes, directory: str) -> str:
    """Write ``data`` to a new file in ``directory`` and open it as a model, a vocabulary and a chat
    template (a new name each time: the tokenizer cache is keyed by path, size and mtime).

    Returns the outcome (``ok`` or the refusing exception's name); raises :class:`Unexpected`.
    """
    path = os.path.join(directory, f"in-{os.getpid()}-{next(_serial)}.gguf")
    with open(path, "wb") as f:
        f.write(data)
    try:
        return _header_steps(path)
    finally:
        os.unlink(path)


def _header_steps(path: str) -> str:
    outcome = "ok"
    for what, step in (("open_model", _open_checked), ("tokenizer", _tokenizer_from), ("template", _template_from)):
        try:
            step(path)
        except AioExpertsError as exc:
            outcome = type(exc).__name__ if what == "open_model" else outcome
        except (Unexpected, Hang, *PASS):
            raise
        except BaseException as exc:  # noqa: BLE001 (any other type breaks the contract)
            raise Unexpected(f"header:{what}", exc) from exc
    return outcome


def _open_checked(path: str) -> None:
    _check_model(open_model(path))


def _tokenizer_from(path: str) -> None:
    tok = Tokenizer.from_gguf(path)
    for text in ("hello world", "a ab b", "<|endoftext|> <tool>é"):
        ids = tok.encode(text, parse_special=True)
        assert all(0 <= i < tok.n_vocab for i in ids), ids
        tok.decode(ids)


def _template_from(path: str) -> None:
    ChatTemplate.from_gguf(path).render([{"role": "user", "content": "hi"}], add_generation_prompt=True)


# ================================================================================================
# door (b): the tokenizer

_TEXT_PIECES = [
    " ",
    "  ",
    "\n",
    "\n\n",
    "\r\n",
    "\t",
    "\u00a0",
    "\u3000",
    "'s",
    "'ll",
    " ?",
    " .",
    "!",
    "0123",
    "12345678901",
    "hello",
    " world",
    "\u00e9",
    "e\u0301",
    "\u65e5\u672c\u8a9e",
    "\U0001f389",
    "\U0001f469\u200d\U0001f4bb",
    "\u0000",
    "\ufffd",
    "\ufeff",
    "\u202e",
    "<s>",
    "</s>",
    "<unk>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|user|>",
    "<|end|>",
    "<|begin_of_text|>",
    "\u2581",
    "\u0120",
    "<0x41>",
    "\ud800",
    "\udfff",
]


def random_text(rnd: random.Random, max_len: int = 200) -> str:
    """Text made of interesting pieces, random code points (any plane, surrogates too) and runs."""
    parts: list[str] = []
    for _ in range(rnd.randrange(1, 12)):
        r = rnd.random()
        if r < 0.4:
            parts.append(_pick(rnd, _TEXT_PIECES))
        elif r < 0.7:
            parts.append("".join(chr(rnd.randrange(0x20, 0x3000)) for _ in range(rnd.randrange(1, 8))))
        elif r < 0.85:
            parts.append("".join(chr(rnd.randrange(0x110000)) for _ in range(rnd.randrange(1, 4))))
        else:
            parts.append(_pick(rnd, _TEXT_PIECES) * rnd.randrange(1, 64))
    text = "".join(parts)
    return text[:max_len] if rnd.random() < 0.98 else text * rnd.randrange(1, 50)


def random_ids(rnd: random.Random, n_vocab: int) -> list[Any]:
    """Token ids for ``decode``: mostly valid, some out of range or not integers at all."""
    out: list[Any] = []
    for _ in range(rnd.randrange(0, 24)):
        r = rnd.random()
        if r < 0.9:
            out.append(rnd.randrange(n_vocab))
        else:
            out.append(_pick(rnd, (-1, n_vocab, 1 << 70, -(1 << 70), True, 1.0, None, "3", b"\x01", [1])))
    return out


def load_tokenizers(names: Sequence[str] | None = None) -> dict[str, Tokenizer]:
    """The shared llama.cpp vocabularies (``/work/shared/vocab`` or ``$AIOEXPERTS_VOCAB``) by short name,
    plus the two tiny synthetic ones; ``names`` picks some."""
    out: dict[str, Tokenizer] = {}
    for name in ("gpt2", "spm"):
        if names is None or f"tiny-{name}" in names:
            path = f"/dev/shm/aioexperts-fuzz-vocab-{name}-{os.getpid()}.gguf"
            Path(path).write_bytes(_vocab_seed("gpt2" if name == "gpt2" else "llama"))
            try:
                out[f"tiny-{name}"] = Tokenizer.from_gguf(path)
            finally:
                os.unlink(path)
    for path in shared_vocab_paths():
        short = path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")
        if names is None or short in names:
            out[short] = Tokenizer.from_gguf(path)
    return out


def tokenizer_door(tok: Tokenizer, text: Any, ids: Sequence[Any], flags: int) -> str:
    """Encode ``text`` (any value) and decode what comes out, whole and incrementally; decode ``ids``.

    ``flags`` picks ``add_special``, ``parse_special`` and ``skip_special`` (bits 0, 1, 2).
    """
    add, parse, skip = bool(flags & 1), bool(flags & 2), bool(flags & 4)
    outcome = "ok"
    try:
        try:
            got = tok.encode(text, add_special=add, parse_special=parse)
        except AioExpertsError as exc:
            outcome = type(exc).__name__
            got = None
        if got is not None:
            assert isinstance(got, list) and all(type(i) is int and 0 <= i < tok.n_vocab for i in got), got
            whole = tok.decode(got, skip_special=skip)
            dec = tok.decoder(skip_special=skip)
            pieces = [dec.feed(i) for i in got]
            pieces.append(dec.flush())
            assert "".join(pieces) == whole, (whole, pieces)
            if not add and not parse and round_trips(tok) and isinstance(text, str):
                assert whole == text, (text, whole)
        try:
            tok.decode(ids, skip_special=skip)
        except AioExpertsError:
            pass
    except (Unexpected, Hang, *PASS):
        raise
    except BaseException as exc:  # noqa: BLE001
        raise Unexpected(f"tokenizer:{tok.pre or tok.model}", exc) from exc
    return outcome


def round_trips(tok: Tokenizer) -> bool:
    """Whether ``decode(encode(t))`` must give ``t`` back: byte-level BPE without llama.cpp's
    clean_spaces (which drops the space before punctuation on purpose)."""
    return not tok._is_spm and not tok._clean_spaces and not tok._escape_whitespaces


# ================================================================================================
# door (c): the chat template renderer


def load_templates() -> dict[str, ChatTemplate]:
    """The templates of ``chat-goldens.json``'s vocabularies and the built-in model's ChatML one."""
    from aioexperts.testing._full_model import CHATML_TEMPLATE

    out = {"chatml": ChatTemplate(CHATML_TEMPLATE, bos_token="<s>", eos_token="<|im_end|>")}
    for path in shared_vocab_paths():
        goldens = path.with_name("chat-goldens.json")
        if goldens.exists() and path.name in json.loads(goldens.read_text()):
            out[path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")] = ChatTemplate.from_gguf(path)
    return out


_ROLES = ["system", "user", "assistant", "tool", "developer", "", "User", "ipython", "function"]
_MESSAGE_KEYS = ["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "thinking"]


def random_json(rnd: random.Random, depth: int = 0, *, texts: bool = True) -> Any:
    """A random JSON-like value (None, bools, ints of any size, floats with inf/nan, strings, nesting)."""
    r = rnd.random()
    if depth > 4 or r < 0.5:
        return _pick(
            rnd,
            (
                None,
                True,
                False,
                0,
                -1,
                rnd.randint(-(1 << 70), 1 << 70),
                10**400,
                1.5,
                float("inf"),
                float("nan"),
                -0.0,
                1e308,
                random_text(rnd, 40) if texts else "x",
                "",
            ),
        )
    if r < 0.75:
        return [random_json(rnd, depth + 1, texts=texts) for _ in range(rnd.randrange(4))]
    keys = _MESSAGE_KEYS + ["type", "text", "function", "arguments", "x"]
    return {_pick(rnd, keys): random_json(rnd, depth + 1, texts=texts) for _ in range(rnd.randrange(4))}


def random_message(rnd: random.Random) -> Any:
    r = rnd.random()
    if r < 0.05:
        return random_json(rnd)
    msg: dict[Any, Any] = {}
    if rnd.random() < 0.95:
        msg["role"] = _pick(rnd, _ROLES) if rnd.random() < 0.9 else random_json(rnd)
    if rnd.random() < 0.95:
        c = rnd.random()
        if c < 0.5:
            msg["content"] = random_text(rnd)
        elif c < 0.6:
            msg["content"] = None
        elif c < 0.8:
            msg["content"] = [
                {"type": _pick(rnd, ("text", "image_url", 1)), "text": random_text(rnd, 30)} for _ in range(3)
            ]
        else:
            msg["content"] = random_json(rnd)
    for _ in range(rnd.randrange(3)):
        msg[_pick(rnd, _MESSAGE_KEYS)] = random_json(rnd)
    if rnd.random() < 0.02:
        msg[1] = "non-str key"
    return msg


def random_messages(rnd: random.Random) -> Any:
    r = rnd.random()
    if r < 0.03:
        return random_json(rnd)
    msgs = [random_message(rnd) for _ in range(rnd.randrange(0, 6))]
    r = rnd.random()
    if r < 0.02:
        msgs = [{"role": _pick(rnd, _ROLES), "content": random_text(rnd, 40)} for _ in range(2000)]  # many turns
    elif r < 0.04 and msgs and isinstance(msgs[0], dict):
        msgs[0]["content"] = "x" * (1 << 20)  # a megabyte of content
    if rnd.random() < 0.01 and msgs and isinstance(msgs[0], dict):
        msgs[0]["self"] = msgs[0]  # a cycle
    return tuple(msgs) if rnd.random() < 0.05 else msgs


def chat_door(template: ChatTemplate, messages: Any, tools: Any, add_generation_prompt: bool) -> str:
    try:
        out = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except AioExpertsError as exc:
        return type(exc).__name__
    except (Unexpected, Hang, *PASS):
        raise
    except BaseException as exc:  # noqa: BLE001
        raise Unexpected("chat", exc) from exc
    if not isinstance(out, str):
        raise Unexpected("chat", AssertionError(f"render gave {type(out).__name__}"))
    return "ok"


# ================================================================================================
# door (d): the server's request validation

_FIELDS = {
    "model": lambda rnd: _pick(rnd, ("m", "", None, 1)),
    "messages": lambda rnd: random_messages(rnd),
    "prompt": lambda rnd: _pick(
        rnd,
        (
            random_text(rnd, 60),
            "",
            [random_text(rnd, 10)],
            [[1, 2, 3]],
            [1, 2, 3],
            [],
            [-1],
            [True],
            [1.0],
            [[1], [2]],
            ["a", "b"],
            None,
            {"a": 1},
        ),
    ),
    "max_tokens": lambda rnd: _number(rnd),
    "max_completion_tokens": lambda rnd: _number(rnd),
    "temperature": lambda rnd: _number(rnd),
    "top_p": lambda rnd: _number(rnd),
    "top_k": lambda rnd: _number(rnd),
    "min_p": lambda rnd: _number(rnd),
    "repeat_penalty": lambda rnd: _number(rnd),
    "presence_penalty": lambda rnd: _number(rnd),
    "frequency_penalty": lambda rnd: _number(rnd),
    "seed": lambda rnd: _number(rnd),
    "n": lambda rnd: _number(rnd),
    "best_of": lambda rnd: _number(rnd),
    "logprobs": lambda rnd: _pick(rnd, (True, False, None, _number(rnd))),
    "top_logprobs": lambda rnd: _number(rnd),
    "stream": lambda rnd: _pick(rnd, (True, False, None, 1, "true")),
    "stream_options": lambda rnd: _pick(rnd, ({"include_usage": True}, {"include_usage": 1}, [], None, {})),
    "stop": lambda rnd: _pick(rnd, ("\n", "", ["a", "b"], [1], ["x"] * 40, None, {}, [None])),
    "echo": lambda rnd: _pick(rnd, (True, False, None, 0)),
    "suffix": lambda rnd: _pick(rnd, ("x", "", None)),
    "logit_bias": lambda rnd: _pick(rnd, ({"1": 2}, {}, None)),
    "tools": lambda rnd: _pick(rnd, ([{"type": "function"}], [], None)),
    "response_format": lambda rnd: _pick(rnd, ({"type": "text"}, {"type": "json_object"}, "text", None, [])),
}


def _number(rnd: random.Random) -> Any:
    return _pick(
        rnd,
        (
            0,
            1,
            -1,
            2,
            20,
            21,
            0.5,
            1.0,
            2.0,
            2.5,
            1e308,
            -1e308,
            2**31 - 1,
            2**31,
            2**64 - 1,
            2**64,
            10**400,
            -(10**400),
            1e-320,
            True,
            None,
            "1",
            [1],
            {},
            rnd.uniform(-3, 3),
            rnd.randint(-100, 100),
        ),
    )


def random_body(rnd: random.Random) -> Any:
    """A request body as a Python value: mostly a plausible request with odd fields, sometimes any JSON."""
    if rnd.random() < 0.1:
        return random_json(rnd)
    body: dict[str, Any] = {}
    if rnd.random() < 0.5:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "Once"
    for name in rnd.sample(list(_FIELDS), rnd.randrange(0, 6)):
        body[name] = _FIELDS[name](rnd)
    return body


def encode_body(rnd: random.Random, body: Any) -> bytes:
    """``body`` as bytes: JSON (Python's, so NaN/Infinity can appear), then maybe mangled."""
    try:
        text = json.dumps(body, ensure_ascii=rnd.random() < 0.5)
    except (ValueError, TypeError, RecursionError):
        text = "{}"
    raw = text.encode("utf-8", "surrogatepass")
    r = rnd.random()
    if r < 0.1:
        raw = text.encode(_pick(rnd, ("utf-16", "utf-16-le", "utf-32", "latin-1")), "replace")
    elif r < 0.25 and raw:
        b = bytearray(raw)
        for _ in range(rnd.randrange(1, 4)):
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        raw = bytes(b)
    elif r < 0.3:
        raw = raw[: rnd.randrange(len(raw) + 1)]
    elif r < 0.33:
        open_, close = _pick(rnd, (("[", "]"), ('{"a":', "}")))
        depth = _pick(rnd, (10, 100, 1000, 5000, 100000))
        raw = (open_ * depth + "1" + close * depth).encode()
    elif r < 0.35:
        raw = rnd.randbytes(rnd.randrange(64))
    elif r < 0.37:
        raw = ('{"prompt": "x", "n": ' + "9" * rnd.choice((400, 4300, 5000)) + "}").encode()
    return raw


def serve_door(raw: bytes) -> str:
    """Parse ``raw`` as a request body, then validate it as a chat and as a completion request."""
    outcomes = []
    try:
        try:
            body = parse_json(raw)
        except APIError as exc:
            _check_api_error(exc)
            return f"json:{exc.status}"
        for parse in (parse_chat, parse_completion):
            try:
                parse(body)
                outcomes.append("ok")
            except APIError as exc:
                _check_api_error(exc)
                outcomes.append(str(exc.status))
    except (Unexpected, Hang, *PASS):
        raise
    except BaseException as exc:  # noqa: BLE001
        raise Unexpected("serve", exc) from exc
    return "/".join(outcomes)


def _check_api_error(exc: APIError) -> None:
    """The error is an OpenAI-style 4xx error object that serialises as strict JSON."""
    assert 400 <= exc.status < 500, exc.status
    body = exc.body()
    assert set(body) == {"error"} and isinstance(body["error"]["message"], str) and body["error"]["type"], body
    json.loads(strict_dumps(body))


def serve_value_door(body: Any) -> str:
    """Validate an already parsed value (any JSON value) as a chat and as a completion request."""
    if not isinstance(body, dict):
        return serve_door(json.dumps(body, allow_nan=True).encode()) if _dumpable(body) else "skip"
    outcomes = []
    for parse in (parse_chat, parse_completion):
        try:
            parse(body)
            outcomes.append("ok")
        except APIError as exc:
            try:
                _check_api_error(exc)
            except AssertionError as bad:
                raise Unexpected("serve", bad) from exc
            outcomes.append(str(exc.status))
        except (Unexpected, Hang, *PASS):
            raise
        except BaseException as exc:  # noqa: BLE001
            raise Unexpected("serve", exc) from exc
    return "/".join(outcomes)


def _dumpable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        return False
    return True
