"""The built-in model's generator: realistic quantized weights, numerically sane, safe to build twice."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import aioexperts
from aioexperts._format.dequant import dequantize
from aioexperts.testing import SyntheticSpec, ensure_bench_model, write_synthetic_model
from aioexperts.testing._blocks import draw_blocks, quantize_q4_k

SMALL = SyntheticSpec(n_layer=3, n_embd=256, n_ff_exp=256, n_expert=16, n_expert_used=4)


def test_q4_k_quantizer_matches_the_reference_layout() -> None:
    x = np.random.default_rng(3).standard_normal((64, 256), dtype=np.float32)
    blocks = quantize_q4_k(x)
    assert blocks.shape == (64, 144)
    ref = gguf.quants.dequantize(blocks, Q.Q4_K).reshape(64, 256)
    assert np.array_equal(dequantize(blocks.reshape(-1), Q.Q4_K, (64, 256)), ref)
    assert np.corrcoef(x.ravel(), ref.ravel())[0, 1] > 0.99
    assert np.sqrt(np.mean((ref - x) ** 2)) < 0.12


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_drawn_blocks_are_zero_mean_with_the_wanted_size(qtype: Q) -> None:
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    blocks = draw_blocks(np.random.default_rng(0), qtype, 4096, target_std=0.05)
    assert blocks is not None
    w = dequantize(blocks.reshape(-1), qtype, (4096, block_size))
    assert abs(float(w.mean())) < 0.02 * float(w.std())
    assert 0.04 < float(w.std()) < 0.06


def _expert_weights(path: Path) -> np.ndarray:
    model = aioexperts.open_model(path)
    layout = aioexperts.build_layout(model)
    loc = layout.locate(next(iter(layout.layers)), 0)
    data = Path(path).read_bytes()
    seg = loc.segments[0]
    return dequantize(np.frombuffer(data[seg.offset : seg.end], dtype=np.uint8), seg.ggml_type, seg.shape)


def test_expert_weights_are_quantized_zero_mean_data(tmp_path: Path) -> None:
    path = write_synthetic_model(tmp_path / "m.gguf", SMALL)[0]
    w = _expert_weights(path)
    assert w.shape == (256, 256)
    assert abs(float(w.mean())) < 0.02 * float(w.std())
    assert float(w.std()) == pytest.approx(256**-0.5, rel=0.25)


def test_a_residual_loop_stays_finite_for_100_tokens(tmp_path: Path) -> None:
    path = write_synthetic_model(tmp_path / "m.gguf", SMALL)[0]

    def norm(h: np.ndarray) -> np.ndarray:
        return (h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6)).astype(np.float32)

    async def run() -> np.ndarray:
        rng = np.random.default_rng(0)
        out = []
        async with aioexperts.open(path, slots=48) as store:
            runner = aioexperts.MoERunner(store)
            for _ in range(100):
                h = rng.standard_normal((1, SMALL.n_embd), dtype=np.float32)
                for layer in store.layout.layers:
                    h = h + await runner.moe(layer, norm(h))
                out.append(h)
        return np.concatenate(out)

    h = anyio.run(run)
    assert np.all(np.isfinite(h))
    rms = np.sqrt(np.mean(h * h, axis=-1))
    assert rms.max() < 10  # inputs have rms 1; each layer adds about its input's size at most


def test_two_builds_at_once_build_once(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "model.gguf"
    built: list[Path] = []
    results: list[Path] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def build() -> None:
        try:
            barrier.wait()
            results.append(ensure_bench_model(spec=SMALL, path=target, on_build=built.append))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [target, target] and built == [target]
    aioexperts.open_model(target)  # complete and valid
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf", "model.gguf.lock"]
    stamp = target.stat().st_mtime_ns
    assert ensure_bench_model(spec=SMALL, path=target) == target and target.stat().st_mtime_ns == stamp


def test_an_interrupted_build_leaves_no_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "model.gguf"

    def progress(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ensure_bench_model(spec=SMALL, path=target, progress=progress)
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf.lock"]


def test_a_killed_builds_partial_file_is_removed_by_the_next_build(tmp_path: Path) -> None:
    """A build killed by SIGKILL or SIGTERM runs no clean-up: its temporary file stayed for ever
    beside the model (up to 17 GB for the 48-layer one; fresh-user trial). The next build removes it."""
    target = tmp_path / "model.gguf"
    left = tmp_path / "model.gguf.x1y2z3.partial"
    left.write_bytes(b"\0" * 4096)
    other = tmp_path / "other.gguf.x1y2z3.partial"  # another model's: not this build's business
    other.write_bytes(b"\0")
    ensure_bench_model(spec=SMALL, path=target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "model.gguf.lock", other.name]


def test_a_cache_folder_that_is_a_file_is_named_in_the_error(tmp_path: Path) -> None:
    """``$AIOEXPERTS_CACHE`` pointing at a file gave a bare ``[Errno 17] File exists`` (fresh-user trial)."""
    cache = tmp_path / "cachefile"
    cache.write_bytes(b"")
    with pytest.raises(NotADirectoryError, match=r"cachefile is not a folder \(set \$AIOEXPERTS_CACHE"):
        ensure_bench_model(spec=SMALL, path=cache / "model.gguf")
    assert cache.read_bytes() == b""  # nothing the user owns is touched
