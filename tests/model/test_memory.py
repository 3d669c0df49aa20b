"""The slab sized from the memory limit: cgroup v1 / v2 files faked under a root, RLIMIT_AS, MemAvailable."""

from __future__ import annotations

import logging
import resource
from pathlib import Path

import pytest

import aioexperts
from aioexperts._cgroups import memory_cgroups
from aioexperts._format.architectures import model_hparams
from aioexperts._model import memory
from aioexperts._model.memory import (
    MemoryLimit,
    check_kv_fits,
    choose_slab_bytes,
    kv_bytes_per_position,
    read_memory_limit,
    resident_weight_bytes,
)

GIB = 1 << 30

V1_MOUNTINFO = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
)
V2_MOUNTINFO = "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _fake(root: Path, *, mountinfo: str, cgroup: str, meminfo_kb: int = 20 * (GIB >> 10)) -> None:
    _write(root, "proc/self/mountinfo", mountinfo)
    _write(root, "proc/self/cgroup", cgroup)
    _write(root, "proc/meminfo", f"MemTotal:       25000000 kB\nMemAvailable:   {meminfo_kb} kB\n")
    _write(root, "proc/self/status", "Name:\tpython\nVmSize:\t  1048576 kB\n")


def test_cgroup_v1_limit_minus_usage_is_the_available_memory(tmp_path: Path) -> None:
    _fake(tmp_path, mountinfo=V1_MOUNTINFO, cgroup="4:memory:/bench/run\n1:cpu:/\n0::/\n")
    group = "sys/fs/cgroup/memory/bench/run/"
    _write(tmp_path, group + "memory.limit_in_bytes", f"{4 * GIB}\n")
    _write(tmp_path, group + "memory.usage_in_bytes", f"{GIB // 2}\n")
    got = read_memory_limit(str(tmp_path))
    assert got.available == 4 * GIB - GIB // 2
    assert got.source == "cgroup v1 /sys/fs/cgroup/memory/bench/run"
    assert ("MemAvailable", 20 * GIB) in got.sources


def test_an_ancestor_with_a_tighter_limit_wins_and_unlimited_levels_are_skipped(tmp_path: Path) -> None:
    _fake(tmp_path, mountinfo=V1_MOUNTINFO, cgroup="4:memory:/outer/inner\n")
    base = "sys/fs/cgroup/memory/"
    _write(tmp_path, base + "outer/inner/memory.limit_in_bytes", "9223372036854771712\n")  # v1 "no limit"
    _write(tmp_path, base + "outer/inner/memory.usage_in_bytes", "100\n")
    _write(tmp_path, base + "outer/memory.limit_in_bytes", f"{3 * GIB}\n")
    _write(tmp_path, base + "outer/memory.usage_in_bytes", f"{GIB}\n")
    got = read_memory_limit(str(tmp_path))
    assert (got.available, got.source) == (2 * GIB, "cgroup v1 /sys/fs/cgroup/memory/outer")


def test_cgroup_v2_memory_max_and_current(tmp_path: Path) -> None:
    _fake(tmp_path, mountinfo=V2_MOUNTINFO, cgroup="0::/user.slice/job\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/job/memory.max", f"{6 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/job/memory.current", f"{GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/memory.max", "max\n")
    got = read_memory_limit(str(tmp_path))
    assert (got.available, got.source) == (5 * GIB, "cgroup v2 /sys/fs/cgroup/user.slice/job")


def test_no_limit_falls_back_to_mem_available(tmp_path: Path) -> None:
    _fake(tmp_path, mountinfo=V2_MOUNTINFO, cgroup="0::/\n", meminfo_kb=3 * (GIB >> 10))
    _write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    got = read_memory_limit(str(tmp_path))
    assert (got.available, got.source) == (3 * GIB, "MemAvailable")


def test_mem_available_wins_when_it_is_tighter_than_the_cgroup(tmp_path: Path) -> None:
    _fake(tmp_path, mountinfo=V2_MOUNTINFO, cgroup="0::/job\n", meminfo_kb=GIB >> 10)
    _write(tmp_path, "sys/fs/cgroup/job/memory.max", f"{8 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/job/memory.current", "0\n")
    assert read_memory_limit(str(tmp_path)).source == "MemAvailable"


def test_garbage_and_missing_files_are_no_limit(tmp_path: Path) -> None:
    _write(tmp_path, "proc/self/mountinfo", "not a mountinfo line\n - \n")
    _write(tmp_path, "proc/self/cgroup", "garbage\n4:memory:/x\n")
    _write(tmp_path, "sys/fs/cgroup/memory/x/memory.limit_in_bytes", "lots\n")
    got = read_memory_limit(str(tmp_path))
    assert got.source in {"unknown", "RLIMIT_AS"}  # nothing under the fake root is readable


def test_rlimit_as_minus_the_virtual_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(tmp_path, mountinfo=V2_MOUNTINFO, cgroup="0::/\n")
    monkeypatch.setattr(memory.resource, "getrlimit", lambda which: (5 * GIB, resource.RLIM_INFINITY))
    got = read_memory_limit(str(tmp_path))
    assert (got.available, got.source) == (5 * GIB - GIB, "RLIMIT_AS")  # VmSize 1 GiB


def test_the_slab_gets_what_the_weights_kv_and_reserve_leave(tiny_full_model: Path, caplog) -> None:
    gguf = aioexperts.open_model(tiny_full_model)
    hp = model_hparams(gguf)
    resident = resident_weight_bytes(gguf, hp, 1 << 30)
    experts = sum(t.n_bytes for n, t in gguf.tensors.items() if "_exps." in n)
    assert resident + experts == sum(t.n_bytes for t in gguf.tensors.values())
    limit = MemoryLimit(2 * GIB, "cgroup v1 /x", (("cgroup v1 /x", 2 * GIB),))
    with caplog.at_level(logging.INFO, logger="aioexperts"):
        budget = choose_slab_bytes(gguf, hp, kv_bytes=10 << 20, resident_embedding_bytes=1 << 30, limit=limit)
    reserve = memory.RUNTIME_RESERVE_BYTES + int(2 * GIB * memory.RESERVE_FRACTION)
    assert budget.slab_bytes == 2 * GIB - resident - (10 << 20) - reserve and budget.fits
    assert "cgroup v1 /x" in caplog.text and "slab" in caplog.text


def test_a_limit_smaller_than_the_weights_gives_the_minimum_and_a_warning(tiny_full_model: Path, caplog) -> None:
    gguf = aioexperts.open_model(tiny_full_model)
    hp = model_hparams(gguf)
    limit = MemoryLimit(64 << 20, "RLIMIT_AS", (("RLIMIT_AS", 64 << 20),))
    with caplog.at_level(logging.WARNING, logger="aioexperts"):
        budget = choose_slab_bytes(gguf, hp, kv_bytes=0, resident_embedding_bytes=1 << 30, limit=limit)
    assert budget.slab_bytes == 1 and not budget.fits
    assert "no room" in caplog.text


@pytest.mark.anyio
async def test_load_sizes_the_slab_from_the_limit_when_no_size_is_given(
    tiny_full_model: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    async with aioexperts.load(tiny_full_model, n_ctx=64, slots=1) as model:
        slot = model.store.statistics().slot_bytes  # one expert's slot (page-aligned)
    gguf = aioexperts.open_model(tiny_full_model)
    hp = model_hparams(gguf)
    resident = resident_weight_bytes(gguf, hp, 1 << 30)
    kv = memory.kv_reserve_bytes(hp, 64, 1 << 30)
    # room for about 5 experts after weights, KV cache and reserve
    available = int((resident + kv + memory.RUNTIME_RESERVE_BYTES + 5.5 * slot) / (1 - memory.RESERVE_FRACTION))
    monkeypatch.setattr(
        memory, "read_memory_limit", lambda **kw: MemoryLimit(available, "fake", (("fake", available),))
    )
    async with aioexperts.load(tiny_full_model, n_ctx=64) as model:
        assert model.slab_budget is not None and model.slab_budget.limit.source == "fake"
        assert model.store.n_slots == 5
    async with aioexperts.load(tiny_full_model, n_ctx=64, slots=3) as model:  # sized by hand: left alone
        assert model.slab_budget is None and model.store.n_slots == 3


def test_the_kv_check_counts_a_cgroups_inactive_page_cache_as_free(tmp_path: Path) -> None:
    """A cgroup full of cached model file pages must not refuse a KV cache that fits once they are reclaimed."""
    _fake(tmp_path, mountinfo=V2_MOUNTINFO, cgroup="0::/job\n")
    _write(tmp_path, "sys/fs/cgroup/job/memory.max", f"{4 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/job/memory.current", f"{4 * GIB - (GIB >> 4)}\n")
    _write(tmp_path, "sys/fs/cgroup/job/memory.stat", f"anon 123\nfile {3 * GIB}\ninactive_file {2 * GIB}\n")
    assert read_memory_limit(str(tmp_path)).available == GIB >> 4  # the slab's view: usage as charged
    assert read_memory_limit(str(tmp_path), reclaimable=True).available == 2 * GIB + (GIB >> 4)
    _fake(tmp_path, mountinfo=V1_MOUNTINFO, cgroup="4:memory:/job\n")
    base = "sys/fs/cgroup/memory/job/"
    _write(tmp_path, base + "memory.limit_in_bytes", f"{4 * GIB}\n")
    _write(tmp_path, base + "memory.usage_in_bytes", f"{3 * GIB}\n")
    _write(tmp_path, base + "memory.stat", f"inactive_file 1\ntotal_inactive_file {GIB}\n")
    assert read_memory_limit(str(tmp_path), reclaimable=True).available == 2 * GIB
    _write(tmp_path, base + "memory.stat", "garbage\n")
    assert read_memory_limit(str(tmp_path), reclaimable=True).available == GIB


def test_check_kv_fits_names_n_ctx_the_bytes_and_the_limit() -> None:
    limit = MemoryLimit(GIB, "cgroup v2 /sys/fs/cgroup/job", (("cgroup v2 /sys/fs/cgroup/job", GIB),))
    assert check_kv_fits(100, GIB, limit) is limit  # exactly the limit fits
    with pytest.raises(aioexperts.ConfigError) as info:
        check_kv_fits(99999999, 3 * GIB, limit)
    message = str(info.value)
    for needle in (
        "n_ctx=99999999",
        f"{3 * GIB} bytes (3.0 GiB)",
        f"{GIB} bytes (1.0 GiB)",
        "cgroup v2 /sys/fs/cgroup/job",
    ):
        assert needle in message, message
    assert isinstance(info.value, aioexperts.AioExpertsError) and isinstance(info.value, ValueError)


@pytest.mark.anyio
async def test_an_n_ctx_whose_kv_cache_cannot_fit_is_refused_before_anything_is_allocated(
    tiny_full_model: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    """issue 31: n_ctx=99999999 allocated a 191 GiB KV cache (numpy's MemoryError); now ConfigError at start."""
    gguf = aioexperts.open_model(tiny_full_model)
    per = kv_bytes_per_position(model_hparams(gguf), gguf)
    opened: list[object] = []
    real_open = aioexperts._model.model.open_store
    monkeypatch.setattr(aioexperts._model.model, "open_store", lambda *a, **kw: opened.append(a) or real_open(*a, **kw))
    for kw in ({}, {"slots": 4}, {"mode": "pagecache"}):  # the slab sized from the limit or by hand, no slab
        model = aioexperts.load(tiny_full_model, n_ctx=99999999, **kw)  # type: ignore[arg-type]
        with pytest.raises(aioexperts.ConfigError, match=rf"n_ctx=99999999 needs {99999999 * per} bytes") as info:
            async with model:
                pass
        assert "this process may still use" in str(info.value)
    assert opened == []  # refused before the store (and its slab) opened
    # against a limit: just over it is refused, just under it runs and its sequences take n_ctx positions
    room = 1000 * per
    monkeypatch.setattr(memory, "read_memory_limit", lambda **kw: MemoryLimit(room, "fake", (("fake", room),)))
    with pytest.raises(aioexperts.ConfigError, match=rf"more than the {room} bytes .* \(fake\)"):
        async with aioexperts.load(tiny_full_model, n_ctx=1001, slots=4):
            pass
    async with aioexperts.load(tiny_full_model, n_ctx=1000, slots=4) as model:
        async with model.sequence() as seq:
            assert seq.n_ctx == 1000 and model.statistics().kv_bytes_in_use == room


@pytest.mark.anyio
async def test_an_n_ctx_past_the_files_context_length_is_said_once_before_the_store_opens(
    tiny_full_model: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: object, caplog: pytest.LogCaptureFixture
) -> None:
    """As llama.cpp, a larger n_ctx than the file's context length runs, with a warning: said before the
    store opens and the weights load (it came after them), once."""
    said = "n_ctx=1024 is larger than the file's context length 512"
    warned_at_open: list[int] = []
    real_open = aioexperts._model.model.open_store

    def spy(*args: object, **kwargs: object) -> object:
        warned_at_open.append(sum(r.getMessage() == said for r in caplog.records))
        return real_open(*args, **kwargs)

    monkeypatch.setattr(aioexperts._model.model, "open_store", spy)
    with caplog.at_level(logging.WARNING, logger="aioexperts"):
        async with aioexperts.load(tiny_full_model, n_ctx=1024, slots=4) as model:
            assert model.n_ctx == 1024
    assert warned_at_open == [1]
    assert [r.getMessage() for r in caplog.records if "context length" in r.getMessage()] == [said]


@pytest.mark.anyio
async def test_the_default_n_ctx_is_capped_to_the_memory_limit(
    tiny_full_model: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: object, caplog: pytest.LogCaptureFixture
) -> None:
    gguf = aioexperts.open_model(tiny_full_model)
    per = kv_bytes_per_position(model_hparams(gguf), gguf)
    room = 100 * per + per // 2
    monkeypatch.setattr(memory, "read_memory_limit", lambda **kw: MemoryLimit(room, "fake", (("fake", room),)))
    with caplog.at_level(logging.WARNING, logger="aioexperts"):
        async with aioexperts.load(tiny_full_model, slots=4) as model:
            assert model.n_ctx == 100
    assert "capped" in caplog.text and "fake" in caplog.text
    tiny = per // 2  # not one position
    monkeypatch.setattr(memory, "read_memory_limit", lambda **kw: MemoryLimit(tiny, "fake", (("fake", tiny),)))
    with pytest.raises(aioexperts.ConfigError, match="n_ctx=1 needs"):
        async with aioexperts.load(tiny_full_model, slots=4):
            pass


def test_the_kv_estimate_is_the_blocks_cache(tiny_full_model: Path) -> None:
    """kv_bytes_per_position (before the blocks are built) equals what the built blocks cache."""
    from aioexperts._model.kvcache import cache_bytes_per_position

    gguf = aioexperts.open_model(tiny_full_model)
    hp = model_hparams(gguf)
    shapes = [{"k": (hp.n_head_kv, hp.head_k), "v": (hp.n_head_kv, hp.head_v)}] * hp.n_layer
    assert kv_bytes_per_position(hp, gguf) == cache_bytes_per_position(shapes)


def test_memory_cgroups_take_the_mount_root_off_the_path(tmp_path: Path) -> None:
    """Inside a container the v1 mount's root is the container's cgroup, which /proc/self/cgroup repeats."""
    mountinfo = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    _fake(tmp_path, mountinfo=mountinfo, cgroup="4:memory:/docker/abc/job\n0::/\n")
    assert memory_cgroups(str(tmp_path)) == [("v1", str(tmp_path / "sys/fs/cgroup/memory/job"))]
    _write(tmp_path, "sys/fs/cgroup/memory/job/memory.limit_in_bytes", str(2 * GIB))
    _write(tmp_path, "sys/fs/cgroup/memory/job/memory.usage_in_bytes", str(GIB // 2))
    limit = read_memory_limit(str(tmp_path))
    assert limit.available == GIB + GIB // 2
    assert "cgroup v1" in limit.source


def test_the_bench_creates_its_group_in_the_same_cgroup_the_limit_is_read_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aioexperts_bench import cgroup

    monkeypatch.setattr(cgroup, "memory_cgroups", lambda: [("v2", "/x/v2dir"), ("v1", "/x/v1dir")])
    assert cgroup.own_memory_cgroup() == ("v1", "/x/v1dir")
