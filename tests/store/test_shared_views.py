"""Views built once per slot load and shared by every hit; invalidated when the slot is reused.

The warm hit of ``experts()`` builds no view: the slab source keeps one ``ExpertView`` per cache
entry. These tests hold the invariants that make that safe: a hit gets the very views of the
load it pins, a view never shows another expert's bytes (it is released when its slot is reused,
and a reload gets new views), the warning for arrays outliving the pin still fires, and only at
the last pin.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import anyio
import numpy as np
import pytest
from ioutil import pread_segment

import aioexperts
from aioexperts.testing import SyntheticSpec, write_synthetic_model

pytestmark = pytest.mark.anyio

SPEC = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("shared") / "small.gguf"
    write_synthetic_model(path, SPEC)
    return path


def _mapped(address: int) -> bool:
    """True when a mapping of this process starts at ``address``."""
    with open("/proc/self/maps") as maps:
        return any(line.startswith(f"{address:x}-") for line in maps)


def _views_made(store: aioexperts.ExpertStore) -> int:
    """Projection views the slab has made so far (one per projection of each slot load)."""
    slab = store._source.stack.slab  # type: ignore[attr-defined]
    return int(slab.shared_views_made)


async def test_a_hit_gets_the_views_of_the_load_it_pins(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        before = _views_made(store)
        async with store.experts(0, [1, 2]) as first:
            pass
        built = _views_made(store)
        assert built - before == 6  # two experts, three projections
        for _ in range(3):
            async with store.experts(0, [2, 1]) as again:
                assert again[0] is first[1] and again[1] is first[0]
        assert _views_made(store) == built  # no view was built for the hits
        assert store.statistics().hits == 6


async def test_a_reused_slot_invalidates_its_views_and_a_reload_builds_new_ones(
    model_path: Path, anyio_backend: object
) -> None:
    model = aioexperts.open_model(model_path)
    layout = aioexperts.build_layout(model)
    async with aioexperts.open(model_path, slots=4) as store:
        async with store.experts(0, [3]) as (old,):
            assert old is not None
            kept = old.up.data
        assert bytes(kept) == pread_segment(model, layout.locate(0, 3).up)  # still its slot's expert
        async with store.experts(1, [0, 1, 2, 4]):  # evicts (0, 3): its slot now shows another expert
            pass
        with pytest.raises(ValueError, match="released"):
            bytes(kept)
        with pytest.raises(ValueError, match="released"):
            bytes(old.gate.data)
        async with store.experts(0, [3]) as (new,):  # read again, into whichever slot
            assert new is not None and new is not old
            for name in ("gate", "up", "down"):
                assert bytes(getattr(new, name).data) == pread_segment(model, getattr(layout.locate(0, 3), name))


async def test_views_are_never_those_of_an_earlier_load_of_the_slot(model_path: Path, anyio_backend: object) -> None:
    """Every slot is reused many times over; each hit's views show exactly its expert."""
    model = aioexperts.open_model(model_path)
    layout = aioexperts.build_layout(model)
    want = {(layer, e): pread_segment(model, layout.locate(layer, e).down) for layer in (0, 1) for e in range(8)}
    rng = np.random.default_rng(1)
    async with aioexperts.open(model_path, slots=4) as store:
        for _ in range(60):
            layer = int(rng.integers(2))
            ids = [int(e) for e in rng.choice(8, size=2, replace=False)]
            async with store.experts(layer, ids) as views:
                for e, view in zip(ids, views, strict=True):
                    assert view is not None and (view.layer, view.expert) == (layer, e)
                    assert bytes(view.down.data) == want[(layer, e)]
        st = store.statistics()
        assert st.hits > 0 and st.evictions > 0


async def test_an_array_kept_past_the_last_pin_warns_and_only_then(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        holder_ready, reader_done = anyio.Event(), anyio.Event()
        kept: list[np.ndarray] = []
        seen_at_reader_exit: list[int] = []

        async def holder() -> None:
            async with store.experts(0, [5]):
                holder_ready.set()
                await reader_done.wait()  # still pinned while the reader's block ends

        async def reader() -> None:
            await holder_ready.wait()
            async with store.experts(0, [5]) as (view,):
                assert view is not None
                kept.append(np.frombuffer(view.gate.data, dtype=np.uint8))
            seen_at_reader_exit.append(len(caught))
            reader_done.set()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with anyio.create_task_group() as tg:
                tg.start_soon(holder)
                tg.start_soon(reader)
        assert seen_at_reader_exit == [0]  # not the last pin: the holder still protects the slot
        assert [str(w.message) for w in caught if w.category is ResourceWarning] == [
            "layer 0 expert 5: the gate bytes are still exported (e.g. by np.frombuffer) as the expert is unpinned; "
            "its slot may be reused under them. Drop such arrays inside the experts() block, or keep a copy "
            "(ExpertView.copy())"
        ]
        kept.clear()
        async with store.experts(0, [5]):  # nothing outlives this block: no warning (an error here)
            pass


async def test_close_unmaps_the_slab_although_views_were_shared(model_path: Path, anyio_backend: object) -> None:
    async with aioexperts.open(model_path, slots=4) as store:
        async with store.experts(0, [0, 1]) as views:
            pass
        slab = store._source.stack.slab  # type: ignore[attr-defined]
        start = slab.address
    assert not _mapped(start)
    with pytest.raises(ValueError, match="released"):
        bytes(views[0].gate.data)  # type: ignore[union-attr]


async def test_views_of_a_block_still_open_stay_valid_through_close(model_path: Path, anyio_backend: object) -> None:
    """Found by the state machine: closing the store must not release the views a request still holds."""
    model = aioexperts.open_model(model_path)
    want = pread_segment(model, aioexperts.build_layout(model).locate(1, 3).gate)
    store = aioexperts.open(model_path, slots=4)
    await store.start()
    async with store.experts(1, [3]) as (view,):
        assert view is not None
        await store.aclose()
        assert bytes(view.gate.data) == want  # the mapping stays while this block holds the view


async def test_release_of_a_shared_view_does_nothing_and_the_block_end_still_warns(
    model_path: Path, anyio_backend: object
) -> None:
    """The slab's shared views serve every request of one slot load: a host's ``release()`` must not
    end them (it does nothing), and an array made from a view is still named as the last pin ends."""
    async with aioexperts.open(model_path, slots=4) as store:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with store.experts(0, [1, 2]) as (one, two):
                assert one is not None and two is not None
                kept = np.frombuffer(two.up.data, dtype=np.uint8)
                one.release()
                two.release()
                assert not [w for w in caught if w.category is ResourceWarning]
                assert bytes(one.gate.data) and bytes(two.up.data)  # still the views of the slot load
            messages = [str(w.message) for w in caught if w.category is ResourceWarning]
        assert len(messages) == 1
        assert messages[0].startswith("layer 0 expert 2: the up bytes are still exported")
        assert len(bytes(kept)) == kept.size > 0  # the array keeps its memory readable
        del kept


def test_slab_shared_views_are_read_only_bytes_of_their_span_and_checked() -> None:
    from aioexperts._io.slab import Slab  # the slab itself: the store above builds its views with it

    slab = Slab(3, 8192)
    try:
        a, b = slab.shared_views(2, ((0, 16), (4096, 8)))
        assert (a.format, a.nbytes, a.readonly, b.nbytes) == ("B", 16, True, 8)
        writer = slab.writable_view(2, 4096, 8)
        writer[:] = b"abcdefgh"
        writer.release()
        assert bytes(b) == b"abcdefgh"  # the slot's bytes, in place
        for slot, spans in ((3, ((0, 1),)), (-1, ((0, 1),)), (0, ((8190, 4),)), (0, ((-1, 2),))):
            with pytest.raises(IndexError):
                slab.shared_views(slot, spans)
        a.release()
        b.release()
    finally:
        slab.close()
    assert slab.closed


def test_slab_projection_views_are_the_shared_views_of_their_spans_and_checked() -> None:
    from aioexperts._io.slab import Slab

    slab = Slab(3, 8192)
    try:
        writer = slab.writable_view(1, 0, 8192)
        writer[:] = bytes(range(256)) * 32
        writer.release()
        spans = (0, 16, 4096, 4104, 100, 100)
        views = slab.projection_views(1, spans)
        want = slab.shared_views(1, ((0, 16), (4096, 8), (100, 0)))
        assert [(v.format, v.readonly, bytes(v)) for v in views] == [("B", True, bytes(w)) for w in want]
        assert slab.shared_views_made == 6
        for slot, bad in (
            (3, spans),
            (-1, spans),
            (0, (0, 8193, 0, 1, 0, 1)),
            (0, (-1, 2, 0, 1, 0, 1)),
            (0, (5, 4, 0, 1, 0, 1)),
        ):
            with pytest.raises(IndexError):
                slab.projection_views(slot, bad)
        assert slab.shared_views_made == 6  # nothing made for a refused span
        for v in (*views, *want):
            v.release()
    finally:
        slab.close()
    assert slab.closed
