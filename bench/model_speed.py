"""Whole-model speed: decode compute against expert I/O, prefill against decode, decode at slab sizes.

Usage::

    python bench/model_speed.py --layers 2 --tokens 8 [--prompt 256] [--out model_speed-results.json]

The model is the built-in full model (``aioexperts.testing._full_model``, Qwen3-30B-A3B-shaped) when
that module exists, else a synthetic ``qwen3moe`` of the same attention geometry written here (32
Q8_0 experts per layer, so that it is written in seconds). Figures, each printed next to its target:

- ``compute_io_ratio``: compute per decoded token with every expert resident (all hits), divided by
  the time to read that many experts (k per layer) from a cold store, one layer after the other
  (target <= 0.5), with the compute split into attention, dense FFN, MoE, head and sampling;
- ``prefill_over_decode``: prefill tokens/s of a ``--prompt``-token prompt over decode tokens/s
  (target >= 5);
- decode tokens/s at slabs of 10 %, 25 % and 50 % of the experts, with hit rates and bytes read per
  token.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402

import aioexperts  # noqa: E402

THREADS = aioexperts.IOOptions(backend="threads")


def synthetic_full_model(path: Path, n_layer: int) -> Path:
    """A qwen3moe GGUF with Qwen3-30B-A3B's attention geometry, 32 Q8_0 experts, random weights."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    e, nh, nkv, hd, nx, k, ff, vocab = 2048, 32, 4, 128, 32, 8, 768, 4096
    q8 = gguf.GGMLQuantizationType.Q8_0
    f32 = gguf.GGMLQuantizationType.F32
    w = gguf.GGUFWriter(path, "qwen3moe")
    for key, value in {
        "block_count": n_layer,
        "context_length": 4096,
        "embedding_length": e,
        "feed_forward_length": 6144,
        "attention.head_count": nh,
        "attention.head_count_kv": nkv,
        "attention.key_length": hd,
        "attention.value_length": hd,
        "expert_count": nx,
        "expert_used_count": k,
        "expert_feed_forward_length": ff,
        "vocab_size": vocab,
    }.items():
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_float32("qwen3moe.rope.freq_base", 1e6)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)

    def mat(name: str, shape: tuple[int, ...], scale: float) -> None:
        data = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
        w.add_tensor(name, quantize(data, q8), raw_dtype=q8)

    def vec(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, np.float32), raw_dtype=f32)

    mat("token_embd.weight", (vocab, e), 1.0)
    mat("output.weight", (vocab, e), 3 / np.sqrt(e))
    vec("output_norm.weight", e)
    for il in range(n_layer):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", e)
        vec(p + "ffn_norm.weight", e)
        vec(p + "attn_q_norm.weight", hd)
        vec(p + "attn_k_norm.weight", hd)
        mat(p + "attn_q.weight", (nh * hd, e), 1 / np.sqrt(e))
        mat(p + "attn_k.weight", (nkv * hd, e), 1 / np.sqrt(e))
        mat(p + "attn_v.weight", (nkv * hd, e), 1 / np.sqrt(e))
        mat(p + "attn_output.weight", (e, nh * hd), 1 / np.sqrt(nh * hd * 2 * n_layer))
        w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((nx, e)) / np.sqrt(e)).astype(np.float32))
        mat(p + "ffn_gate_exps.weight", (nx, ff, e), 1 / np.sqrt(e))
        mat(p + "ffn_up_exps.weight", (nx, ff, e), 1 / np.sqrt(e))
        mat(p + "ffn_down_exps.weight", (nx, e, ff), 1 / np.sqrt(ff * 2 * n_layer))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def model_path(n_layer: int, scratch: Path) -> tuple[Path, str]:
    try:
        from aioexperts._bench.full_model import ensure_full_model
    except ImportError:
        target = scratch / f"synthetic-qwen3moe-{n_layer}l-v1.gguf"
        if not target.exists():
            synthetic_full_model(target.with_suffix(".tmp"), n_layer).rename(target)
        return target, "synthetic"
    return ensure_full_model(n_layer), "built-in full model"


async def decode_steps(
    model: aioexperts.Model, prompt: list[int], n: int
) -> tuple[list[float], aioexperts.ModelStatistics, aioexperts.ModelStatistics]:
    """Per-token seconds of ``n`` greedy decode steps after ``prompt``, and the statistics around them."""
    seconds, tokens = [], []
    async with model.sequence() as seq:
        logits = await seq.forward(prompt, all_logits=False)
        before = model.statistics()
        for _ in range(n):
            token = int(np.argmax(logits[0]))
            tokens.append(token)
            t0 = time.perf_counter()
            logits = await seq.forward([token], all_logits=False)
            seconds.append(time.perf_counter() - t0)
        after = model.statistics()
    return seconds, before, after


def split(before: aioexperts.ModelStatistics, after: aioexperts.ModelStatistics, n: int) -> dict[str, float]:
    names = ("attention_seconds", "dense_ffn_seconds", "moe_seconds", "head_seconds", "sampling_seconds")
    return {name.replace("_seconds", "_ms"): (getattr(after, name) - getattr(before, name)) / n * 1e3 for name in names}


async def cold_expert_read_seconds(path: Path, layers: list[int], k: int, n_expert: int, rounds: int) -> float:
    """Seconds to read k experts per layer from a cold store, layer after layer (median of rounds)."""
    rng = np.random.default_rng(1)
    times = []
    for _ in range(rounds):
        async with aioexperts.open(path, slots=k, io=THREADS) as store:
            t0 = time.perf_counter()
            for layer in layers:
                ids = rng.choice(n_expert, size=k, replace=False).tolist()
                async with store.experts(layer, ids):
                    pass
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


async def main(args: argparse.Namespace) -> None:
    started = time.time()
    scratch = Path(tempfile.gettempdir()) / "aioexperts-model-speed"
    scratch.mkdir(exist_ok=True)
    path, kind = model_path(args.layers, scratch)
    rng = np.random.default_rng(0)
    rounds: list[dict[str, Any]] = []
    async with aioexperts.load(path, slots=8, io=THREADS) as probe:
        hp = probe.hparams
        n_vocab = probe.n_vocab
    total = hp.n_layer * hp.moe.n_expert
    prompt = rng.integers(0, n_vocab, size=args.prompt).tolist()
    short = prompt[:8]

    # 1. every expert resident: warm every expert once, then measure
    async with aioexperts.load(path, slots=total, io=THREADS, n_ctx=args.prompt + args.tokens + 8) as model:
        await decode_steps(model, short, args.tokens)  # loads the experts these tokens use
        await model.logits(prompt)  # and the prompt's
        st0 = model.store.statistics()
        seconds, before, after = await decode_steps(model, short, args.tokens)
        st1 = model.store.statistics()
        decode_s = float(np.median(seconds))
        parts = split(before, after, args.tokens)
        t0 = time.perf_counter()
        await model.logits(prompt)
        prefill_s = time.perf_counter() - t0
        hits = (st1.hits - st0.hits) / max(1, st1.requests - st0.requests)
    io_s = await cold_expert_read_seconds(path, list(range(hp.n_layer)), hp.moe.n_expert_used, hp.moe.n_expert, 3)
    ratio = decode_s / io_s
    prefill_rate, decode_rate = args.prompt / prefill_s, 1 / decode_s
    rounds.append({"kind": "resident", "decode_ms": [s * 1e3 for s in seconds], "hit_rate": hits, **parts})
    print(f"model: {kind}, {hp.n_layer} layers, {hp.moe.n_expert} experts, top-{hp.moe.n_expert_used}")
    print(
        f"decode compute per token (all resident, hit rate {hits:.2f}): {decode_s * 1e3:.1f} ms  split: "
        + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
    )
    print(f"cold I/O of one token's experts: {io_s * 1e3:.1f} ms; compute/IO = {ratio:.2f}  (target <= 0.5)")
    print(
        f"prefill {prefill_rate:.1f} tok/s vs decode {decode_rate:.1f} tok/s: "
        f"{prefill_rate / decode_rate:.1f}x  (target >= 5x)"
    )

    slabs = []
    for frac in (0.10, 0.25, 0.50):
        slots = max(hp.moe.n_expert_used, int(total * frac))
        async with aioexperts.load(path, slots=slots, io=THREADS, n_ctx=args.prompt + args.tokens + 8) as model:
            st0 = model.store.statistics()
            t0 = time.perf_counter()
            got = [t async for t in model.generate(short, max_tokens=args.tokens)]
            wall = time.perf_counter() - t0
            st1 = model.store.statistics()
        n = max(1, len(got))
        req = max(1, st1.requests - st0.requests)
        row = {
            "kind": "slab",
            "slab_fraction": frac,
            "slots": slots,
            "tokens_per_second": n / wall,
            "hit_rate": (st1.hits - st0.hits) / req,
            "bytes_read_per_token": (st1.bytes_read - st0.bytes_read) / n,
        }
        slabs.append(row)
        rounds.append(row)
        print(
            f"slab {frac:.0%} ({slots} slots): {row['tokens_per_second']:.2f} tok/s (prompt of 8 included), "
            f"hit rate {row['hit_rate']:.2f}, {row['bytes_read_per_token'] / 2**20:.1f} MiB read per token"
        )
    summary = {
        "model": kind,
        "compute_io_ratio": ratio,
        "compute_io_ratio_target": 0.5,
        "decode_compute_ms": decode_s * 1e3,
        "cold_expert_io_ms": io_s * 1e3,
        "split_ms": parts,
        "prefill_tokens_per_second": prefill_rate,
        "decode_tokens_per_second": decode_rate,
        "prefill_over_decode": prefill_rate / decode_rate,
        "prefill_over_decode_target": 5.0,
        "slabs": slabs,
    }
    out = write_results(
        args.out,
        "model_speed",
        {"layers": args.layers, "tokens": args.tokens, "prompt": args.prompt, "model": kind},
        {"ms": "milliseconds", "tokens_per_second": "tokens/s", "bytes_read_per_token": "bytes"},
        rounds,
        summary,
        started,
    )
    print(f"results: {out}")


def render(results: Path, doc: Path) -> None:
    """Replace the text between ``<!-- bench:model_speed -->`` and its end marker in ``doc``."""
    import json

    r = json.loads(results.read_text())
    s, p = r["summary"], r["parameters"]
    lines = [
        f"<!-- rendered by bench/model_speed.py --render from {results}; do not edit by hand -->",
        f"{s['model']}, {p['layers']} layers, {p['tokens']} decoded tokens, {r['machine'].get('cpu', '?')}, "
        f"{r['machine']['cores_available']} cores, {r['started']}:",
        "",
        "| figure | measured | target |",
        "|---|---|---|",
        f"| decode compute per token, every expert resident | {s['decode_compute_ms']:.1f} ms | |",
        "| of which attention / dense FFN / MoE / head / sampling | "
        + " / ".join(f"{v:.1f}" for v in s["split_ms"].values())
        + " ms | |",
        f"| cold read of one token's experts (k per layer) | {s['cold_expert_io_ms']:.1f} ms | |",
        f"| compute / I/O | {s['compute_io_ratio']:.2f} | <= {s['compute_io_ratio_target']} |",
        f"| prefill ({p['prompt']} tokens) / decode rate | {s['prefill_tokens_per_second']:.1f} / "
        f"{s['decode_tokens_per_second']:.1f} tok/s = {s['prefill_over_decode']:.1f}x "
        f"| >= {s['prefill_over_decode_target']}x |",
    ]
    lines.extend(
        f"| decode, slab {row['slab_fraction']:.0%} of the experts ({row['slots']} slots) | "
        f"{row['tokens_per_second']:.2f} tok/s, hit rate {row['hit_rate']:.2f}, "
        f"{row['bytes_read_per_token'] / 2**20:.1f} MiB/token | |"
        for row in s["slabs"]
    )
    text = doc.read_text()
    start, end = "<!-- bench:model_speed -->", "<!-- /bench:model_speed -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(head + start + "\n" + "\n".join(lines) + "\n" + end + tail)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--render", nargs=2, type=Path, metavar=("RESULTS", "DOC"), help="render RESULTS into DOC, no run")
    return ap.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    if arguments.render:
        render(*arguments.render)
    else:
        anyio.run(main, arguments)
