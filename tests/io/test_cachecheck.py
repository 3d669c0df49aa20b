"""Direct I/O is reported on only where it really bypasses the page cache (issue 31 item 12).

tmpfs accepts ``O_DIRECT`` on this kernel and serves it from memory, and an overlayfs over tmpfs
did the same while ``statfs`` said only "overlayfs": the store reported ``direct_io=True`` there.
The decision (:func:`page_cache_reason`) is tested on injected file-system types and residency;
the mountinfo parse on injected text; and the whole path on real overlay mounts (root only).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import aioexperts
from aioexperts._io.align import RAMFS_MAGIC, TMPFS_MAGIC
from aioexperts._io.cachecheck import (
    OVERLAYFS_MAGIC,
    CacheFacts,
    overlay_layers,
    page_cache_reason,
    page_resident,
    probe_page_cache,
)
from aioexperts._io.files import open_shards
from aioexperts.testing import SyntheticSpec, write_synthetic_model

EXT4 = 0xEF53
XFS = 0x58465342


@pytest.mark.parametrize(
    ("facts", "want"),
    [
        (CacheFacts(TMPFS_MAGIC), "on tmpfs"),
        (CacheFacts(RAMFS_MAGIC, None, False, False), "on ramfs"),
        (CacheFacts(EXT4, None, False, False), None),
        (CacheFacts(EXT4, None, True, True), None),  # a page dirty or mapped elsewhere: no evidence
        (CacheFacts(EXT4), None),  # no probe: the open and the read decide, as before
        (CacheFacts(EXT4, None, False, True), "filled the page cache"),  # a buffered fallback
        (CacheFacts(XFS, None, False, True), "filled the page cache"),
        (CacheFacts(OVERLAYFS_MAGIC, (TMPFS_MAGIC, TMPFS_MAGIC)), "overlayfs over tmpfs"),
        (CacheFacts(OVERLAYFS_MAGIC, (TMPFS_MAGIC, RAMFS_MAGIC), False, False), "overlayfs over ramfs, tmpfs"),
        (CacheFacts(OVERLAYFS_MAGIC, (EXT4, EXT4), True, True), None),  # freshly written: dirty pages
        (CacheFacts(OVERLAYFS_MAGIC, (EXT4, XFS), False, False), None),
        (CacheFacts(OVERLAYFS_MAGIC, (TMPFS_MAGIC, EXT4), True, True), "stays in the page cache"),
        (CacheFacts(OVERLAYFS_MAGIC, (TMPFS_MAGIC, EXT4), False, False), None),  # on the ext4 layer
        (CacheFacts(OVERLAYFS_MAGIC, (TMPFS_MAGIC, EXT4)), "could not be probed"),
        (CacheFacts(OVERLAYFS_MAGIC, None, True, True), "stays in the page cache"),
        (CacheFacts(OVERLAYFS_MAGIC, (EXT4, None), True, False), "stays in the page cache"),
        (CacheFacts(OVERLAYFS_MAGIC, None, False, False), None),
        (CacheFacts(OVERLAYFS_MAGIC), None),
        (CacheFacts(None, None, False, False), None),
    ],
)
def test_the_decision_on_injected_file_system_types_and_residency(facts: CacheFacts, want: str | None) -> None:
    reason = page_cache_reason(facts)
    if want is None:
        assert reason is None
    else:
        assert reason is not None and want in reason


MOUNTINFO = r"""22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:30 / /srv/ov rw,relatime shared:9 - overlay overlay rw,lowerdir=/l1:/l\0402\:x,upperdir=/up,workdir=/wk
31 30 0:31 / /srv/ov/inner rw - ext4 /dev/vdb rw
32 22 0:32 / /srv/new rw - overlay overlay rw,lowerdir+=/a,lowerdir+=/b,datadir+=/d,upperdir=/u,workdir=/w
33 22 0:33 / /srv/ovx rw - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(
    ("path", "want"),
    [
        ("/srv/ov/model.gguf", ["/up", "/l1", "/l 2:x"]),
        ("/srv/ov", ["/up", "/l1", "/l 2:x"]),
        ("/srv/ov/inner/model.gguf", None),  # a mount inside the overlay wins
        ("/srv/ovx/model.gguf", None),  # a prefix of the name is not a parent folder
        ("/srv/new/m.gguf", ["/u", "/a", "/b", "/d"]),
        ("/home/model.gguf", None),
    ],
)
def test_overlay_layers_are_read_from_mountinfo(path: str, want: list[str] | None) -> None:
    assert overlay_layers(path, MOUNTINFO) == want


def test_a_plain_file_s_probe_reads_and_reports_residency(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 * 4096 + 100))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert page_resident(fd, 0) is True  # just written
        facts = probe_page_cache(fd, str(path), path.stat().st_size, 4096)
        assert facts.resident_after is True and facts.resident_before is not None
    finally:
        os.close(fd)


def _small_model(folder: Path) -> Path:
    spec = SyntheticSpec(n_layer=1, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2)
    return write_synthetic_model(folder / "m.gguf", spec)[0]


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount ({' '.join(args[:2])}): {done.stderr.strip() or done.returncode}")


@pytest.fixture
def overlay_over(tmp_path: Path) -> Iterator[object]:
    """``overlay_over(kind)``: an overlayfs mount whose layers are on tmpfs or on tmp_path's file system."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting an overlayfs needs root and mount(8)")
    mounted: list[Path] = []

    def make(kind: str) -> Path:
        base = tmp_path / f"{kind}-{uuid.uuid4().hex[:6]}"
        base.mkdir()
        if kind == "tmpfs":
            _mount("-t", "tmpfs", "tmpfs", str(base))
            mounted.append(base)
        for d in ("lower", "upper", "work", "merged"):
            (base / d).mkdir()
        merged = base / "merged"
        _mount(
            "-t", "overlay", "overlay", "-o",
            f"lowerdir={base / 'lower'},upperdir={base / 'upper'},workdir={base / 'work'}", str(merged),
        )  # fmt: skip
        mounted.append(merged)
        return merged

    yield make
    for point in reversed(mounted):
        subprocess.run(["umount", str(point)], check=False)


def test_overlayfs_over_tmpfs_is_buffered_and_says_why(overlay_over, tmp_path: Path) -> None:
    merged = overlay_over("tmpfs")
    path = _small_model(merged)
    assert overlay_layers(path) is not None
    model = aioexperts.open_model(path)
    shards = open_shards(model)
    try:
        assert not shards.direct_io
        assert shards.buffered_reason is not None and "overlayfs over tmpfs" in shards.buffered_reason
    finally:
        shards.close()
    with pytest.raises(aioexperts.BackendUnavailableError, match="overlayfs over tmpfs"):
        open_shards(model, direct_io=True)


def test_overlayfs_over_a_disk_keeps_direct_io(overlay_over, direct_tmp_path: Path) -> None:
    merged = overlay_over("disk")
    path = _small_model(merged)
    shards = open_shards(aioexperts.open_model(path))
    try:
        assert shards.direct_io and shards.buffered_reason is None
    finally:
        shards.close()


def test_untrusted_residency_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where mincore would call every page resident (a file this process neither owns nor may write)."""
    from aioexperts._io import cachecheck

    monkeypatch.setattr(cachecheck, "residency_trusted", lambda facts: False)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(2 * 4096))
    fd = os.open(path, os.O_RDONLY)
    try:
        facts = probe_page_cache(fd, str(path), path.stat().st_size, 4096)
    finally:
        os.close(fd)
    assert (facts.resident_before, facts.resident_after) == (None, None)
