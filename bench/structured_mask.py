"""Structured output: per-token cost of the grammar mask, by library, at the built-in model's vocabulary.

For each library that imports (llguidance, outlines-core, xgrammar), and each JSON schema of
:data:`SCHEMAS`: the compile time (the tokenizer view built once before, not counted), then a
generation of up to ``--tokens`` tokens driven by random logits (the most likely allowed token each
step), timing per token the mask computation plus applying it to the logits plus advancing the
grammar; against it, the same argmax on unmasked logits (decoding without a mask). The median per
token goes to the results file (``--json``, default ``structured_mask-results.json``; the committed
copy is docs/results/structured-mask.json).

    python bench/structured_mask.py --tokens 200 --json docs/results/structured-mask.json

A library that is not installed is reported as such (xgrammar needs torch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _results import write_results  # bench/_results.py, a sibling module

import aioexperts
from aioexperts.testing import builtin_model_path

SCHEMAS: dict[str, dict[str, Any]] = {
    "object": {"type": "object"},
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
            "kind": {"enum": ["a", "b", "c"]},
        },
        "required": ["name", "age", "tags", "kind"],
        "additionalProperties": False,
    },
}

Step = Callable[[np.ndarray], int]  # logits -> the chosen token, the grammar advanced


def llguidance_steps(tok: aioexperts.Tokenizer, n_vocab: int) -> Callable[[dict[str, Any]], Step]:
    con = aioexperts.TokenConstraint.json_object(tok, n_vocab)  # builds the tokenizer view once

    def compile_(schema: dict[str, Any]) -> Step:
        c = aioexperts.TokenConstraint.json_schema(tok, schema, n_vocab)
        return lambda logits: c.choose(logits, lambda masked: int(np.argmax(masked)))

    del con
    return compile_


def outlines_steps(tok: aioexperts.Tokenizer, n_vocab: int) -> Callable[[dict[str, Any]], Step]:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    eos = min(tok.eog_ids)
    mapping: dict[bytes, list[int]] = {}
    for i in range(tok.n_vocab):
        if tok.is_control(i) or i in tok.eog_ids:
            continue
        piece = tok.piece(i)
        if piece:
            mapping.setdefault(piece, []).append(i)
    vocab = outlines_core.Vocabulary(eos, mapping)
    words = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    def compile_(schema: dict[str, Any]) -> Step:
        index = outlines_core.Index(build_regex_from_schema(json.dumps(schema, allow_nan=False)), vocab)
        guide = outlines_core.Guide(index)

        def step(logits: np.ndarray) -> int:
            guide.write_mask_into(words.ctypes.data, words.size, 4)
            allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:n_vocab].astype(bool)
            token = int(np.argmax(np.where(allowed, logits, -np.inf)))
            if token != eos:
                guide.advance(token)
            return token

        return step

    return compile_


def xgrammar_steps(tok: aioexperts.Tokenizer, n_vocab: int) -> Callable[[dict[str, Any]], Step]:
    import xgrammar  # noqa: F401  (needs torch; reported as not installed otherwise)

    raise ImportError("xgrammar's numpy path is not wired in this bench")


LIBRARIES = {"llguidance": llguidance_steps, "outlines-core": outlines_steps, "xgrammar": xgrammar_steps}


def run(tokens: int, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    tok = aioexperts.Tokenizer.from_gguf(builtin_model_path())
    n_vocab = tok.n_vocab
    eog = tok.eog_ids
    rounds: list[dict[str, Any]] = []
    rng = np.random.default_rng(seed)
    logits_seq = rng.standard_normal((tokens, n_vocab)).astype(np.float32)
    plain = []
    for row in logits_seq:
        t0 = time.perf_counter()
        int(np.argmax(row))
        plain.append(time.perf_counter() - t0)
    rounds.append({"library": "none", "schema": "-", "per_token_us": 1e6 * statistics.median(plain)})
    notes: dict[str, Any] = {}
    for name, setup in LIBRARIES.items():
        try:
            t0 = time.perf_counter()
            compile_ = setup(tok, n_vocab)
            vocab_s = time.perf_counter() - t0
        except ImportError as exc:
            notes[name] = f"not installed: {exc}"
            print(f"{name}: not installed ({exc})")
            continue
        for label, schema in SCHEMAS.items():
            t0 = time.perf_counter()
            step = compile_(schema)
            compile_s = time.perf_counter() - t0
            times, out = [], []
            for row in logits_seq:
                t0 = time.perf_counter()
                token = step(row)
                times.append(time.perf_counter() - t0)
                if token in eog:
                    break
                out.append(token)
            text = tok.decode(out)
            rounds.append(
                {
                    "library": name,
                    "schema": label,
                    "vocabulary_seconds": vocab_s,
                    "compile_seconds": compile_s,
                    "tokens": len(times),
                    "per_token_us": 1e6 * statistics.median(times),
                    "per_token_max_us": 1e6 * max(times),
                    "valid_json": _parses(text),
                }
            )
            r = rounds[-1]
            print(
                f"{name:14s} {label:7s} vocab {vocab_s:6.2f}s compile {compile_s * 1e3:8.1f} ms "
                f"{r['tokens']:4d} tokens median {r['per_token_us']:8.1f} us/token (max {r['per_token_max_us']:.0f})"
            )
    return rounds, notes, n_vocab


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=200, help="tokens per generation at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="the results file")
    args = p.parse_args()
    started = time.time()
    rounds, notes, n_vocab = run(args.tokens, args.seed)
    summary = {f"{r['library']}/{r['schema']}": r["per_token_us"] for r in rounds}
    out = write_results(
        args.json,
        "structured_mask",
        {"tokens": args.tokens, "seed": args.seed, "n_vocab": n_vocab, "model": os.path.basename(builtin_model_path())},
        {"per_token_us": "microseconds per token (median)", "compile_seconds": "s"},
        rounds,
        {"per_token_us": summary, "notes": notes},
        started,
    )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
