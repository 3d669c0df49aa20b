"""The low-precision miss tier (issue 36): the sidecar written, reopened and refused when stale or
mismatched; which misses go low on a scripted backend, upgrades of low copies hit again, hits never
downgraded; the tier's numbers against the default path's (a synthetic model and llama.cpp's fixtures)."""

from __future__ import annotations

import os
import re
import shutil
from datetime import datetime
from pathlib import Path

import anyio
import gguf_bytes as gb
import numpy as np
import pytest
from conftest import shared_fixture_paths
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, GGUFWriter
from tierkit import fake_store, settle

import aioexperts
from aioexperts import ConfigError, FormatError, MissTier, StaleMapError, write_miss_tier
from aioexperts._format.dequant import dequantize
from aioexperts._format.layout import build_layout
from aioexperts._format.model import GGUFModel, open_model
from aioexperts._format.tier_sidecar import (
    TIER_ARCH,
    TIER_KEYS,
    read_tier_sidecar,
    tier_expert_name,
    tier_tensor_name,
)
from aioexperts._io.plan import plan_expert
from aioexperts._router import Routing
from aioexperts._tier_policy import low_tier_misses
from aioexperts.testing import FakeBackend, SyntheticSpec, write_synthetic_model

SPEC = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)
#: logits rel L2 of the Q3_K tier against the default path on llama.cpp's Q4_K_M qwen3moe fixture
#: (random weights, 8 tokens, 8 slots), by max_gate_weight (None: every read low, prefetches too).
#: Measured: None 0.185 (Q2_K 0.336, IQ4_XS 0.099), 0.3: 0.016 (3 of 19 misses and 1 of 3
#: prefetches low); docs/miss-tier.md
FIXTURE_LOGITS_REL_L2 = {None: 0.25, 0.3: 0.02}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tier") / "model.gguf"
    write_synthetic_model(path, SPEC)
    return path


@pytest.fixture(scope="module")
def sidecar(model: Path) -> Path:
    return write_miss_tier(model, model.with_suffix(".q3k.gguf"), "Q3_K")


def pread(path: str, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        return os.pread(f.fileno(), n, offset)


# -- the sidecar ------------------------------------------------------------------------------------


def test_sidecar_holds_every_expert_requantized(model: Path, sidecar: Path) -> None:
    gguf = open_model(model)
    layout = build_layout(gguf)
    tier = read_tier_sidecar(sidecar, gguf, layout)
    assert tier.ggml_type == T.Q3_K and len(tier.segments) == SPEC.n_layer * SPEC.n_expert
    for loc in (layout.locate(0, 0), layout.locate(1, 7)):
        low = tier.location(loc, 1)
        for full_seg, low_seg in zip(loc.segments, low.segments, strict=True):
            assert low_seg.shape == full_seg.shape and low_seg.n_bytes < full_seg.n_bytes
            full = dequantize(
                np.frombuffer(pread(str(model), full_seg.offset, full_seg.n_bytes), np.uint8),
                full_seg.ggml_type,
                full_seg.shape,
            )
            back = dequantize(
                np.frombuffer(pread(str(sidecar), low_seg.offset, low_seg.n_bytes), np.uint8), T.Q3_K, low_seg.shape
            )
            assert np.linalg.norm(back - full) / np.linalg.norm(full) < 0.2  # Q3_K of Gaussian-like weights


def test_each_expert_of_the_sidecar_is_one_contiguous_read(model: Path, sidecar: Path) -> None:
    gguf = open_model(model)
    layout = build_layout(gguf)
    tier = read_tier_sidecar(sidecar, gguf, layout)
    ends = []
    for loc in layout:
        gate, up, down = tier.location(loc, 1).segments
        assert gate.offset + gate.n_bytes == up.offset and up.offset + up.n_bytes == down.offset
        assert len(plan_expert(tier.location(loc, 1), 4096).reads) == 1
        ends.append((gate.offset, down.offset + down.n_bytes))
    ends.sort()
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False))  # no expert overlaps another


def _write_sidecar(
    out: Path, model_of: GGUFModel, version: int, ggml_type: T, tensors: list[tuple[str, np.ndarray, T]]
) -> Path:
    """A sidecar file of ``version`` keyed to the model ``model_of``'s sidecar was (its identity
    arrays copied) holding ``tensors`` (name, bytes, ggml type: gguf infers the shape)."""
    writer = GGUFWriter(out, TIER_ARCH)
    writer.add_uint32(TIER_KEYS["version"], version)
    for key, value in model_of.metadata.items():
        if key.startswith("aioexperts.miss_tier.model."):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT64)
    writer.add_uint32(TIER_KEYS["type"], int(ggml_type))
    for name, data, raw_type in tensors:
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _as_version_1(sidecar: Path, gguf_model: Path, out: Path) -> Path:
    """The version-1 file of the same experts: three stacked tensors per bank (what older releases wrote)."""
    side = open_model(sidecar)
    gguf = open_model(gguf_model)
    layout = build_layout(gguf)
    tier = read_tier_sidecar(sidecar, gguf, layout)
    tensors = []
    for moe in layout.layers.values():
        for bank in moe.banks:
            for p, projection in enumerate(("gate", "up", "down")):
                rows = [
                    np.frombuffer(pread(str(sidecar), seg.offset, seg.n_bytes), np.uint8)
                    for seg in (tier.segments[moe.index, bank.first_expert + e][p] for e in range(bank.n_experts))
                ]
                n_rows = tier.segments[moe.index, bank.first_expert][p].shape[0]
                data = np.stack(rows).reshape(bank.n_experts, n_rows, -1)  # bytes per row: gguf infers the shape
                tensors.append((tier_tensor_name(moe.index, projection, bank.index), data, tier.ggml_type))
    return _write_sidecar(out, side, 1, tier.ggml_type, tensors)


def test_a_version_1_sidecar_is_still_read_as_the_same_experts(model: Path, sidecar: Path, tmp_path: Path) -> None:
    old = _as_version_1(sidecar, model, tmp_path / "v1.gguf")
    gguf = open_model(model)
    layout = build_layout(gguf)
    new_tier, old_tier = read_tier_sidecar(sidecar, gguf, layout), read_tier_sidecar(old, gguf, layout)
    assert old_tier.ggml_type == new_tier.ggml_type and old_tier.segments.keys() == new_tier.segments.keys()
    for key, segs in new_tier.segments.items():
        for new, was in zip(segs, old_tier.segments[key], strict=True):
            assert new.shape == was.shape and new.n_bytes == was.n_bytes
            assert pread(str(sidecar), new.offset, new.n_bytes) == pread(str(old), was.offset, was.n_bytes)
    assert len(plan_expert(old_tier.location(layout.locate(0, 0), 1), 4096).reads) == 3  # apart in version 1


def test_a_malformed_version_2_sidecar_is_a_format_error(model: Path, sidecar: Path, tmp_path: Path) -> None:
    gguf = open_model(model)
    layout = build_layout(gguf)
    side = open_model(sidecar)
    n_bytes = side.tensors[tier_expert_name(0, 0, 0)].n_bytes

    def rewrite(name: str, version: int = 2, drop: str | None = None, short: str | None = None) -> Path:
        tensors = [
            (
                tname,
                np.frombuffer(pread(str(sidecar), info.data_offset, info.n_bytes - 32 * (tname == short)), np.int8),
                T.I8,
            )
            for tname, info in side.tensors.items()
            if tname != drop
        ]
        return _write_sidecar(tmp_path / name, side, version, T.Q3_K, tensors)

    assert read_tier_sidecar(rewrite("same.gguf"), gguf, layout).segments.keys() == {
        (moe, e) for moe in range(SPEC.n_layer) for e in range(SPEC.n_expert)
    }
    name = tier_expert_name(1, 0, 7)
    with pytest.raises(FormatError, match=rf"tensor '{re.escape(name)}' is missing \(layer 1, bank 0, expert 7\)"):
        read_tier_sidecar(rewrite("missing.gguf", drop=name), gguf, layout)
    with pytest.raises(
        FormatError, match=rf"{re.escape(name)} is I8 \[{n_bytes - 32}\], the model needs I8 \[{n_bytes}\]"
    ):
        read_tier_sidecar(rewrite("short.gguf", short=name), gguf, layout)
    with pytest.raises(FormatError, match="version 3; this aioexperts reads versions 1, 2"):
        read_tier_sidecar(rewrite("v3.gguf", version=3), gguf, layout)


def test_a_stale_or_foreign_sidecar_is_refused(model: Path, sidecar: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(model, copy)
    with pytest.raises(StaleMapError, match="written for another file than copy.gguf") as info:  # inode
        read_tier_sidecar(sidecar, open_model(copy), build_layout(open_model(copy)))
    assert "does not match the model" in str(info.value)
    assert str(info.value).endswith(f"write it again with aioexperts-tier {copy} -o {sidecar}")
    st = os.stat(copy)
    own = write_miss_tier(copy, tmp_path / "copy.tier.gguf", "Q2_K")
    gguf = open_model(copy)
    assert read_tier_sidecar(own, gguf, build_layout(gguf)).ggml_type == T.Q2_K
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the model "changed" since
    gguf = open_model(copy)
    with pytest.raises(StaleMapError) as info:
        read_tier_sidecar(own, gguf, build_layout(gguf))
    then = datetime.fromtimestamp(st.st_mtime_ns // 10**9).astimezone().isoformat()
    now = datetime.fromtimestamp(st.st_mtime_ns // 10**9 + 1).astimezone().isoformat()
    assert str(info.value).endswith(  # in words and ISO times, with the command that writes it again
        f"the sidecar was written for an earlier version of copy.gguf (modified {now} after the sidecar's "
        f"record of {then}); write it again with aioexperts-tier {copy} -o {own} --type Q2_K"
    )
    assert "[" not in str(info.value)  # no raw lists of inodes or mtime_ns: those are on the exception
    assert info.value.recorded is not None and info.value.current is not None
    assert info.value.current["mtimes"] == [info.value.recorded["mtimes"][0] + 10**9] == [st.st_mtime_ns + 10**9]
    with open(copy, "ab") as f:  # a longer file of the same inode: its size is named too
        f.write(b"\0" * 32)
    gguf = open_model(copy)
    longer = rf"it is {st.st_size + 32} bytes long, the sidecar recorded {st.st_size}\)"
    with pytest.raises(StaleMapError, match=longer):
        read_tier_sidecar(own, gguf, build_layout(gguf))
    os.truncate(copy, st.st_size)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(FormatError, match="not a miss-tier sidecar"):
        read_tier_sidecar(copy, gguf, build_layout(gguf))
    with pytest.raises(ConfigError, match="Q2_K, Q3_K, IQ4_XS"):
        write_miss_tier(copy, tmp_path / "x.gguf", "Q4_K")
    assert not (tmp_path / "x.gguf").exists()
    one = write_miss_tier(copy, tmp_path / "one-thread.gguf", "Q2_K", threads=1)
    assert one.read_bytes()[-4096:] == own.read_bytes()[-4096:]  # experts in parallel: the same bytes
    assert one.stat().st_size == own.stat().st_size


@pytest.mark.anyio
async def test_a_stale_sidecar_is_refused_when_the_store_starts(
    model: Path, sidecar: Path, tmp_path: Path, anyio_backend: object
) -> None:
    other = tmp_path / "other.gguf"
    write_synthetic_model(other, SPEC)
    store = aioexperts.open(other, slots=8, miss_tier=MissTier(path=str(sidecar)))
    with pytest.raises(StaleMapError):
        await store.start()
    with pytest.raises(ConfigError, match="slab mode"):
        aioexperts.open(model, mode="pagecache", miss_tier=MissTier(path=str(sidecar)))
    with pytest.raises(ConfigError, match="max_gate_weight"):
        MissTier(path=str(sidecar), max_gate_weight=-1)


# -- the policy on a scripted backend ----------------------------------------------------------------


@pytest.mark.anyio
async def test_low_misses_hits_as_resident_and_upgrades(model: Path, sidecar: Path, anyio_backend: object) -> None:
    holder: dict[str, FakeBackend] = {}
    async with fake_store(model, holder, MissTier(path=str(sidecar), upgrade=True)) as store:
        fake = holder["fake"]

        async def pinned_types(ids: list[int]) -> list[T]:
            async with store.experts(0, ids) as views:
                return [v.gate.ggml_type for v in views if v is not None]

        full = build_layout(open_model(model)).locate(0, 0).gate.ggml_type
        store.start_loads(0, [0, 1], low_ids=[1])  # 0 at full precision, 1 from the low tier
        assert await pinned_types([0, 1]) == [full, T.Q3_K]
        st = store.statistics()
        assert st.demand_misses == 2 and st.low_tier_misses == 1 and st.tier_upgrades == 0
        shards = [op.shard for op, _ in fake.completed]
        assert shards.count(0) == 3  # the full copy: gate, up and down from their stacked tensors
        assert shards.count(1) == 1  # the low copy: one read, its gate, up and down adjacent

        # a hit is served by what is resident: expert 0 stays full although the step asks low for it
        store.start_loads(0, [0, 1], low_ids=[0, 1])
        assert await pinned_types([0, 1]) == [full, T.Q3_K]  # 1's low copy is used as it is ...
        await settle()
        st = store.statistics()
        assert st.tier_upgrades == 1 and st.cached_hits == 2  # ... and read again at full precision after
        assert await pinned_types([1]) == [full]
        assert [op.shard for op, _ in fake.completed].count(0) == 6
        assert store.statistics().low_tier_misses == 1


def routing(ids: list[list[int]], weights: list[list[float]]) -> Routing:
    return Routing(
        x=np.zeros((len(ids), 4), np.float32),
        ids=np.array(ids, np.int32),
        weights=np.array(weights, np.float32),
        groups=[],
        prefetch=[],
    )


def test_the_policy_chooses_by_gate_weight_and_backlog() -> None:
    calls = [routing([[0, 1], [2, 1]], [[0.9, 0.1], [0.6, 0.4]]), routing([[3, 0]], [[0.05, 0.95]])]
    weight = MissTier(path="x", max_gate_weight=0.3)
    assert low_tier_misses(weight, [0, 1, 2, 3], calls, None) == [3]  # 1 has 0.4 in one row: full
    backlog = MissTier(path="x", behind_seconds=0.05)
    assert low_tier_misses(backlog, [0, 3], calls, None) == []  # no rate measured yet
    assert low_tier_misses(backlog, [0, 3], calls, 0.01) == []
    assert low_tier_misses(backlog, [0, 3], calls, 0.2) == [0, 3]
    both = MissTier(path="x", max_gate_weight=0.3, behind_seconds=0.05)
    assert low_tier_misses(both, [0, 1, 3], calls, 0.01) == [3]
    assert low_tier_misses(MissTier(path="x"), [2, 0], calls, None) == [2, 0]  # no rule: every miss


# -- numbers with the tier on ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_runner_with_every_miss_low_stays_near_the_default(
    model: Path, sidecar: Path, anyio_backend: object
) -> None:
    x = np.random.default_rng(5).standard_normal((3, SPEC.n_embd)).astype(np.float32)
    outs = []
    for tier in (None, MissTier(path=str(sidecar))):
        async with aioexperts.open(model, slots=15, miss_tier=tier) as store:  # 16: the tier would be off
            runner = aioexperts.MoERunner(store, prefetch=aioexperts.PrefetchOptions(predictor="none"))
            outs.append(await runner.moe(0, x))
            st = store.statistics()
            assert st.low_tier_misses == (0 if tier is None else st.demand_misses) and st.demand_misses > 0
    default, low = outs
    rel = np.linalg.norm(low - default) / np.linalg.norm(default)
    assert 0 < rel < 0.25


@pytest.mark.anyio
async def test_the_runner_warms_the_tier_type_before_the_first_token(
    model: Path, sidecar: Path, anyio_backend: object
) -> None:
    """The low tier's kernels are compiled or loaded at warm-up, not by the first low-tier expert
    (mid-token: the first decode token under the tier took 1.5 s instead of 0.3 s)."""
    for tier, slots in ((None, 15), (MissTier(path=str(sidecar)), 15), (MissTier(path=str(sidecar)), 16)):
        async with aioexperts.open(model, slots=slots, miss_tier=tier) as store:  # 16 slots: the tier is off
            expected = None if tier is None or slots == 16 else T.Q3_K
            assert store.miss_tier_type == expected
            report = await aioexperts.MoERunner(store).warmup()
            assert ("Q3_K" in report.types) == (expected is not None), report.types


FIXTURE = next((p for p in shared_fixture_paths() if p.name == "qwen3moe-q4_k_m.gguf"), None)


@pytest.fixture(scope="module")
def fixture_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert FIXTURE is not None
    return write_miss_tier(FIXTURE, tmp_path_factory.mktemp("fixture") / "fixture.tier.gguf", "Q3_K")


@pytest.mark.anyio
@pytest.mark.skipif(FIXTURE is None, reason="llama.cpp's fixtures are not here (qwen3moe-q4_k_m.gguf)")
@pytest.mark.parametrize("max_gate_weight", [None, 0.3])
async def test_fixture_logits_with_the_tier_within_the_documented_bound(
    fixture_sidecar: Path, max_gate_weight: float | None, anyio_backend: object
) -> None:
    assert FIXTURE is not None
    side = fixture_sidecar
    tokens = [1, 5, 9, 14, 3, 22, 40, 7]
    logits = []
    for tier in (None, MissTier(path=str(side), max_gate_weight=max_gate_weight)):
        async with aioexperts.load(FIXTURE, slots=8, n_ctx=64, miss_tier=tier) as m:
            logits.append(await m.logits(tokens))
            if tier is not None:
                assert m.store.statistics().low_tier_misses > 0
    default, low = logits
    rel = float(np.linalg.norm(low - default) / np.linalg.norm(default))
    assert 0 < rel < FIXTURE_LOGITS_REL_L2[max_gate_weight], rel


@pytest.mark.anyio
async def test_without_upgrades_a_low_copy_hit_again_stays_low(
    model: Path, sidecar: Path, anyio_backend: object
) -> None:
    holder: dict[str, FakeBackend] = {}
    async with fake_store(model, holder, MissTier(path=str(sidecar), upgrade=False)) as store:
        store.start_loads(0, [2], low_ids=[2])
        for _ in range(3):
            async with store.experts(0, [2]) as views:
                assert views[0] is not None and views[0].gate.ggml_type == T.Q3_K
            await settle()
        st = store.statistics()
        assert st.tier_upgrades == 0 and st.low_tier_misses == 1 and st.cached_hits == 2


# -- outputs, misplaced files, NextN blocks (a new-user trial) ---------------------------------------


def test_writing_over_any_file_of_the_model_is_refused(model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m.gguf"
    shutil.copyfile(model, copy)
    before = copy.read_bytes()
    (tmp_path / "link.gguf").symlink_to(copy)
    os.link(copy, tmp_path / "hard.gguf")
    for out in (copy, tmp_path / "link.gguf", tmp_path / "hard.gguf", tmp_path / "sub" / ".." / "m.gguf"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(ConfigError, match="is the model file .*m.gguf: refusing to write over it"):
            write_miss_tier(copy, out, "Q2_K")
    assert copy.read_bytes() == before
    with pytest.raises(ConfigError, match="the sidecar's path is empty"):
        write_miss_tier(copy, "", "Q2_K")
    for out in (f"{tmp_path}/newdir/", tmp_path / "sub"):
        with pytest.raises(ConfigError, match="names a directory, not a file"):
            write_miss_tier(copy, out, "Q2_K")
    assert not (tmp_path / "newdir").exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_sidecar_given_as_the_model_is_named_as_such(tiny_full_model: Path, tmp_path: Path) -> None:
    from aioexperts._format.architectures import model_hparams
    from aioexperts._text.vocab import read_vocabulary as read_vocab

    sidecar = write_miss_tier(tiny_full_model, tmp_path / "tiny.tier.gguf", "Q2_K")
    want = rf"tiny.tier.gguf is a miss-tier sidecar of {re.escape(tiny_full_model.name)}, not a model: pass the model"
    with pytest.raises(FormatError, match=want):
        model_hparams(open_model(sidecar))  # aioexperts.load's first look at the file
    with pytest.raises(FormatError, match=want):
        read_vocab(sidecar)  # aioexperts-run's first look at it


@pytest.mark.anyio
async def test_a_nextn_block_kept_by_the_layout_is_read_in_full(tmp_path: Path, anyio_backend: object) -> None:
    def prepare() -> Path:  # blocking: off the event loop
        path = gb.glm4moe_experts(tmp_path / "n.gguf", range(3), 3, nextn=1, width=256)  # block 2: NextN
        sidecar = write_miss_tier(path, tmp_path / "n.tier.gguf", "Q2_K")
        assert len(read_tier_sidecar(sidecar, open_model(path), build_layout(open_model(path))).segments) == 2 * 4
        return sidecar

    sidecar = await anyio.to_thread.run_sync(prepare)
    path = tmp_path / "n.gguf"
    tier = MissTier(path=sidecar)
    async with aioexperts.open(path, slots=2, include_nextn=True, miss_tier=tier) as store:
        assert list(store.layout.layers) == [0, 1, 2]
        got = []
        for layer in (0, 2):
            store.start_loads(layer, [0], low_ids=[0])
            async with store.experts(layer, [0]) as (view,):
                got.append(view.gate.ggml_type)
        assert got == [T.Q2_K, T.F32]  # block 2 (NextN) has no low copy: read in full
        st = store.statistics()
        assert st.low_tier_misses == 1 and st.demand_misses == 2
