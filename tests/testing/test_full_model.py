"""The built-in full model: every qwen3moe tensor, a consistent vocabulary, a ChatML template, sane numbers."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import aioexperts
from aioexperts import ChatTemplate, ConfigError
from aioexperts._format.dequant import dequantize
from aioexperts._format.header import read_header
from aioexperts.testing import ensure_full_model, full_model_path, print_progress, progress_bytes
from aioexperts.testing._full_model import CHATML_TEMPLATE, FULL_SPEC, FullModelSpec, write_full_model

TINY = FullModelSpec(
    n_layer=2,
    n_embd=256,
    n_head=4,
    n_head_kv=2,
    head_dim=64,
    n_expert=4,
    n_expert_used=2,
    n_ff_exp=256,
    vocab_size=600,
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_full_model(tmp_path_factory.mktemp("full") / "tiny.gguf", TINY)


def _expected_tensors(spec: FullModelSpec, n_vocab: int) -> dict[str, tuple[tuple[int, ...], Q]]:
    """llama.cpp's qwen3moe tensors (src/models/qwen3moe.cpp), ggml dims (fastest first)."""
    e, hd, f, x = spec.n_embd, spec.head_dim, spec.n_ff_exp, spec.n_expert
    want = {
        "token_embd.weight": ((e, n_vocab), spec.dense_type),
        "output_norm.weight": ((e,), Q.F32),
        "output.weight": ((e, n_vocab), spec.dense_type),
    }
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        want |= {
            b + "attn_norm.weight": ((e,), Q.F32),
            b + "attn_q.weight": ((e, spec.n_head * hd), spec.dense_type),
            b + "attn_k.weight": ((e, spec.n_head_kv * hd), spec.dense_type),
            b + "attn_v.weight": ((e, spec.n_head_kv * hd), spec.dense_type),
            b + "attn_output.weight": ((spec.n_head * hd, e), spec.dense_type),
            b + "attn_q_norm.weight": ((hd,), Q.F32),
            b + "attn_k_norm.weight": ((hd,), Q.F32),
            b + "ffn_norm.weight": ((e,), Q.F32),
            b + "ffn_gate_inp.weight": ((e, x), Q.F32),
            b + "ffn_gate_exps.weight": ((e, f, x), spec.expert_type),
            b + "ffn_up_exps.weight": ((e, f, x), spec.expert_type),
            b + "ffn_down_exps.weight": ((f, e, x), spec.expert_type),
        }
    return want


def test_every_qwen3moe_tensor_exists_with_its_shape_and_type(tiny_path: Path) -> None:
    model = aioexperts.open_model(tiny_path)
    n_vocab = len(model.metadata["tokenizer.ggml.tokens"])
    got = {name: (tuple(t.dims), t.ggml_type) for name, t in model.tensors.items()}
    assert got == _expected_tensors(TINY, n_vocab)
    layout = aioexperts.build_layout(model)
    assert sorted(layout.layers) == [0, 1]


def test_the_hyperparameters_are_qwen3_30b_a3b_s(tiny_path: Path) -> None:
    meta = read_header(str(tiny_path)).metadata
    assert meta["general.architecture"] == "qwen3moe"
    assert meta["qwen3moe.attention.head_count"] == TINY.n_head
    assert meta["qwen3moe.attention.head_count_kv"] == TINY.n_head_kv
    assert meta["qwen3moe.attention.key_length"] == meta["qwen3moe.attention.value_length"] == TINY.head_dim
    assert meta["qwen3moe.expert_count"] == TINY.n_expert and meta["qwen3moe.expert_used_count"] == TINY.n_expert_used
    assert meta["qwen3moe.rope.freq_base"] == 1e6
    assert meta["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert meta["qwen3moe.context_length"] == 40960
    assert (FULL_SPEC.n_embd, FULL_SPEC.n_head, FULL_SPEC.n_head_kv, FULL_SPEC.head_dim) == (2048, 32, 4, 128)
    assert (FULL_SPEC.n_expert, FULL_SPEC.n_expert_used, FULL_SPEC.n_ff_exp) == (128, 8, 768)


def test_the_vocabulary_is_a_consistent_byte_level_bpe(tiny_path: Path) -> None:
    meta = read_header(str(tiny_path)).metadata
    model = aioexperts.open_model(tiny_path)
    tokens, types, merges = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "merges"))
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    assert len(tokens) == len(types) == model.tensors["token_embd.weight"].dims[1] <= TINY.vocab_size
    assert len(set(tokens)) == len(tokens)
    byte_tokens = tokens[:256]
    assert len(set(byte_tokens)) == 256 and all(len(t) == 1 for t in byte_tokens)
    assert tokens[-3:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert [t for t, k in zip(tokens, types, strict=True) if k == 3] == tokens[-3:]
    assert set(types[:-3]) == {1}
    assert tokens[meta["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    index = set(tokens)
    for merge in merges:  # every merge joins two tokens into a third that is in the vocabulary
        left, right = merge.split(" ")
        assert left in index and right in index and left + right in index
    assert len(merges) == len(tokens) - 256 - 3


def test_the_full_vocabulary_has_thousands_of_merges(tmp_path: Path) -> None:
    from aioexperts.testing._full_model import train_vocabulary

    tokens, merges = train_vocabulary(FULL_SPEC.vocab_size)
    assert 2000 <= len(merges) and len(tokens) <= FULL_SPEC.vocab_size
    assert train_vocabulary(FULL_SPEC.vocab_size) == (tokens, merges)  # the same file every time


def test_the_chat_template_renders_chatml(tiny_path: Path) -> None:
    template = ChatTemplate.from_gguf(tiny_path)
    assert template.source == CHATML_TEMPLATE and template.eos_token == "<|im_end|>"
    out = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert out == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def _tensor(model: aioexperts.GGUFModel, path: Path, name: str) -> np.ndarray:
    info = model.tensors[name]
    data = np.fromfile(path, dtype=np.uint8, count=info.n_bytes, offset=info.data_offset)
    dims = tuple(reversed(info.dims))
    rows = int(np.prod(dims[:-1]))
    return dequantize(data, info.ggml_type, (rows, dims[-1])).reshape(dims)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def test_one_token_through_48_layers_stays_finite_with_sane_logits(tmp_path: Path) -> None:
    """A first token (position 0: RoPE is the identity and attention returns V) through every layer."""
    spec = TINY.with_(n_layer=48)
    path = write_full_model(tmp_path / "deep.gguf", spec)
    model = aioexperts.open_model(path)
    t = lambda name: _tensor(model, path, name)  # noqa: E731
    eps = spec.rms_eps
    x = t("token_embd.weight")[[300, 5]]  # two independent first tokens
    norms = []
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        h = _rms_norm(x, t(b + "attn_norm.weight"), eps)
        v = (h @ t(b + "attn_v.weight").T).reshape(2, spec.n_head_kv, spec.head_dim)
        attn = np.repeat(v, spec.n_head // spec.n_head_kv, axis=1).reshape(2, -1)  # softmax over one key is 1
        x = x + attn @ t(b + "attn_output.weight").T
        h = _rms_norm(x, t(b + "ffn_norm.weight"), eps)
        logits = h @ t(b + "ffn_gate_inp.weight").T
        out = np.zeros_like(x)
        gate, up, down = (t(b + f"ffn_{p}_exps.weight") for p in ("gate", "up", "down"))
        for row in range(2):
            top = np.argsort(-logits[row])[: spec.n_expert_used]
            weights = np.exp(logits[row, top] - logits[row, top].max())
            weights /= weights.sum()
            for e, w in zip(top, weights, strict=True):
                g, u = gate[e] @ h[row], up[e] @ h[row]
                out[row] += w * (down[e] @ (g / (1 + np.exp(-g)) * u))
        x = x + out
        norms.append(float(np.sqrt(np.mean(x * x))))
    head = _rms_norm(x, t("output_norm.weight"), eps) @ t("output.weight").T
    assert np.isfinite(head).all()
    assert 0.3 < norms[-1] / norms[0] < 3.0, norms  # the residual stays of order one
    assert 1.0 < float(head.std()) < 6.0  # about logit_std = 3


def test_progress_bytes_says_sizes_in_the_unit_that_fits_the_total() -> None:
    assert progress_bytes(1_230_000_000, 2_900_000_000) == "1.23 of 2.90 GB"
    assert progress_bytes(0, 2_100_000) == "0.00 of 2.10 MB"
    assert progress_bytes(12_290, 409_600) == "12.29 of 409.60 kB"
    assert progress_bytes(12, 512) == "12 of 512 bytes"


def test_ensure_writes_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOEXPERTS_CACHE", str(tmp_path / "cache"))
    lines: list[str] = []

    class Lines:
        def write(self, s: str) -> None:
            lines.append(s)

        def flush(self) -> None:
            pass

    builds: list[Path] = []
    results: list[Path] = []

    def run() -> None:
        results.append(ensure_full_model(spec=TINY, progress=print_progress(Lines()), on_build=builds.append))  # type: ignore[arg-type]

    threads = [threading.Thread(target=run) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(builds) == 1 and results[0] == results[1] and results[0].parent == tmp_path / "cache"
    assert any("written" in s for s in lines)
    assert results[0].stat().st_size < 10**7  # a tiny model: its progress in MB, never "0.00 of 0.00 GB"
    written = [s for s in lines if "written" in s]
    assert all(re.fullmatch(r"  written \d+\.\d\d of [1-9]\.\d\d MB", s) for s in written), written
    assert written[-1].split()[1] == written[-1].split()[3]  # the last line: all of it
    mtime = results[0].stat().st_mtime_ns
    assert ensure_full_model(spec=TINY) == results[0] and results[0].stat().st_mtime_ns == mtime
    assert ensure_full_model(spec=TINY, rebuild=True).stat().st_mtime_ns != mtime
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_a_build_clears_other_sizes_killed_partials_but_not_one_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build of a size never asked for again, killed by SIGTERM (no clean-up), left its 17 GB
    ``.partial``: the next build of any size removes it, unless its lock is held (being written)."""
    import fcntl
    import os

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("AIOEXPERTS_CACHE", str(cache))
    dead = cache / "other-49l.gguf.abc123.partial"
    dead.write_bytes(b"x" * 100)
    (cache / "other-49l.gguf.lock").touch()
    live = cache / "busy-50l.gguf.def456.partial"
    live.write_bytes(b"y")
    fd = os.open(cache / "busy-50l.gguf.lock", os.O_RDWR | os.O_CREAT)
    foreign = cache / "notes.txt.partial"  # no lock file: not the cache's, left alone
    foreign.write_bytes(b"z")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another build holds it (flock locks are per open file)
        ensure_full_model(spec=TINY)
    finally:
        os.close(fd)
    assert not dead.exists() and live.exists() and foreign.exists()


def test_a_build_that_cannot_fit_on_the_disk_does_not_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model larger than the free space is refused before a byte is written (ENOSPC, needed and free named)."""
    import errno
    import shutil
    from collections import namedtuple

    monkeypatch.setenv("AIOEXPERTS_CACHE", str(tmp_path / "cache"))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 10**6, 10**6))
    builds: list[Path] = []
    with pytest.raises(OSError, match=r"needs \d+\.\d GB of free space, .* has 0\.0 GB") as exc:
        ensure_full_model(spec=TINY, on_build=builds.append)
    assert exc.value.errno == errno.ENOSPC
    assert not list((tmp_path / "cache").glob("*.partial")) and not (tmp_path / "cache" / TINY.file_name()).exists()
    # refused before "writing the built-in full model ... (once)" is said, and no 0-byte NAME.lock is left
    assert builds == [] and list((tmp_path / "cache").iterdir()) == []


def test_the_size_estimate_is_the_written_tensors_at_most(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOEXPERTS_CACHE", str(tmp_path))
    path = ensure_full_model(spec=TINY)
    data_bytes = sum(t.n_bytes for t in aioexperts.open_model(path).tensors.values())
    assert data_bytes <= TINY.tensor_bytes() < data_bytes + 2 * TINY.vocab_size * TINY.n_embd


def test_the_cache_names_differ_by_depth_and_geometry() -> None:
    assert full_model_path(4) != full_model_path(48)
    assert "48l" in full_model_path(48).name
    assert TINY.file_name() != FULL_SPEC.with_(n_layer=2).file_name()
    assert TINY.file_name() == TINY.with_().file_name()


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"n_layer": 0}, "n_layer"),
        ({"n_head": 5}, "n_head"),
        ({"n_expert_used": 9}, "n_expert_used"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"n_ff_exp": 200}, "expert_type"),
        ({"dense_type": Q.Q6_K}, "no block pool"),
    ],
)
def test_an_inconsistent_spec_is_a_config_error(tmp_path: Path, changes: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        write_full_model(tmp_path / "x.gguf", TINY.with_(**changes))


def test_the_cache_names_of_the_spread_and_skewed_files() -> None:
    from aioexperts.testing._full_model import SKEWED_SPEC

    assert FULL_SPEC.with_(n_layer=48).file_name() == "qwen3-30b-a3b-geometry-full-q8_0-q4_k-48l-v2.gguf"
    assert SKEWED_SPEC.with_(n_layer=48).file_name() == "qwen3-30b-a3b-geometry-full-q8_0-q4_k-48l-hot8-v2.gguf"
    assert "-custom" in FULL_SPEC.with_(hot_experts=3).file_name()


@pytest.mark.parametrize("bad", [{"hot_experts": -1}, {"hot_experts": 128}, {"hot_logit": -1.0}, {"n_embd": 64}])
def test_bad_routing_fields_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="FullModelSpec"):
        FULL_SPEC.with_(**bad).check()


ROUTED = TINY.with_(n_expert=32, n_expert_used=4)


def _top_k_counts(spec: FullModelSpec, path: Path) -> np.ndarray:
    """How often each expert of layer 0 is in the top-k of the RMS-normalised token embeddings."""
    model = aioexperts.open_model(path)
    emb = _tensor(model, path, "token_embd.weight")[256:-3]
    router = _tensor(model, path, "blk.0.ffn_gate_inp.weight")
    x = _rms_norm(emb, np.ones(emb.shape[1], dtype=np.float32), spec.rms_eps)
    top = np.argsort(-(x @ router.T), axis=1)[:, : spec.n_expert_used]
    return np.bincount(top.ravel(), minlength=spec.n_expert)


def test_the_routers_rows_are_orthogonal_of_equal_norm_and_spread_the_tokens(tmp_path: Path) -> None:
    path = write_full_model(tmp_path / "spread.gguf", ROUTED)
    model = aioexperts.open_model(path)
    router = _tensor(model, path, "blk.1.ffn_gate_inp.weight")
    np.testing.assert_allclose(router @ router.T, np.eye(ROUTED.n_expert) * ROUTED.router_logit_std**2, atol=1e-5)
    counts = _top_k_counts(ROUTED, path)
    share = counts / counts.sum()
    assert share.max() < 3 / ROUTED.n_expert and (counts > 0).all()  # no expert hot, none unused


def test_the_skewed_routers_send_most_tokens_to_the_hot_experts(tmp_path: Path) -> None:
    spec = ROUTED.with_(hot_experts=2)
    path = write_full_model(tmp_path / "skewed.gguf", spec)
    counts = np.sort(_top_k_counts(spec, path))[::-1]
    n_tokens = counts.sum() / spec.n_expert_used
    assert (counts[:2] > 0.6 * n_tokens).all()  # each hot expert picked by most tokens
    assert counts[2] < 0.3 * n_tokens


def test_builtin_model_path_writes_the_model_once_and_its_size_knob_picks_the_tiny_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The docs' examples open builtin_model_path(); $AIOEXPERTS_BUILTIN_SIZE=tiny makes it small."""
    from aioexperts.testing import TINY_FULL_SPEC, builtin_model_path

    monkeypatch.setenv("AIOEXPERTS_CACHE", str(tmp_path))
    monkeypatch.setenv("AIOEXPERTS_BUILTIN_SIZE", "tiny")
    seen: list[tuple[int, int]] = []
    path = builtin_model_path(progress=lambda done, total: seen.append((done, total)))
    assert isinstance(path, str) and Path(path) == tmp_path / TINY_FULL_SPEC.file_name()
    assert seen and seen[-1][0] == seen[-1][1]
    assert aioexperts.open_model(path).architecture == "qwen3moe"
    seen.clear()
    assert builtin_model_path(progress=lambda done, total: seen.append((done, total))) == path and not seen
    monkeypatch.setenv("AIOEXPERTS_BUILTIN_SIZE", "huge")
    with pytest.raises(ConfigError, match="AIOEXPERTS_BUILTIN_SIZE='huge'"):
        builtin_model_path()
